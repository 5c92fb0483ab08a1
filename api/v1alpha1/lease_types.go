package v1alpha1

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
)

// What a lease leaves for the next one, and the lease hooks: a set's (or
// its class's) spec.jumpstarter.leaseStatePolicy and spec.jumpstarter.hooks.
// They reach the pods as annotations, which the node's exporter reads.

const (
	// LeaseStatePolicyAnnotation is on the pods of a set whose effective
	// leaseStatePolicy is Keep (value "Keep"). Absent means Reset.
	LeaseStatePolicyAnnotation = "qemu-kubelet.io/lease-state-policy"
	// LeaseHooksAnnotation holds a set's effective lease hooks (LeaseHooks)
	// as compact JSON. Absent: no hooks.
	LeaseHooksAnnotation = "qemu-kubelet.io/lease-hooks"
)

// LeaseStatePolicy says what a lease leaves for the next one.
// +kubebuilder:validation:Enum=Reset;Keep
type LeaseStatePolicy string

const (
	// LeaseStatePolicyReset returns the target to what the set defines
	// when a lease ends (the default): a flashed image, flashed firmware
	// and sizes set through the exporter are dropped, and the VM boots
	// again, powered on, from the pod's image (a fresh disk unless the
	// set's statePolicy is Retain) with the set's guest login.
	LeaseStatePolicyReset LeaseStatePolicy = "Reset"
	// LeaseStatePolicyKeep leaves the target as the lease left it: the next
	// lease sees what the last one flashed, resized and powered.
	LeaseStatePolicyKeep LeaseStatePolicy = "Keep"
)

// LeaseHookAction is one thing a lease hook does to the VM.
// +kubebuilder:validation:Enum=powerOn;powerOff;powerCycle;reset;exec;flash
type LeaseHookAction string

const (
	// LeaseHookPowerOn powers the VM on (nothing when it runs).
	LeaseHookPowerOn LeaseHookAction = "powerOn"
	// LeaseHookPowerOff powers the VM off at once (nothing when it is off).
	LeaseHookPowerOff LeaseHookAction = "powerOff"
	// LeaseHookPowerCycle powers the VM off and on again.
	LeaseHookPowerCycle LeaseHookAction = "powerCycle"
	// LeaseHookReset returns the VM to what the set defines, as
	// leaseStatePolicy Reset does at a lease's end.
	LeaseHookReset LeaseHookAction = "reset"
	// LeaseHookExec runs the step's command in the guest through
	// qemu-guest-agent (no shell); a non-zero exit fails the step.
	LeaseHookExec LeaseHookAction = "exec"
	// LeaseHookFlash flashes the step's image onto a partition as a
	// lease's flash_oci does, pulling it with what the node may pull for
	// anyone (no lease's credentials, no pod's pull secrets).
	LeaseHookFlash LeaseHookAction = "flash"
)

// LeaseHookImagePattern is the form of a flash step's image: an OCI
// reference with a tag or a digest (no oci:// prefix).
const LeaseHookImagePattern = `^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)*(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127}(@sha256:[a-f0-9]{64})?|@sha256:[a-f0-9]{64})$`

var leaseHookImage = regexp.MustCompile(LeaseHookImagePattern)

// LeaseHookFlashPartitions are the partitions a flash step may write.
var LeaseHookFlashPartitions = []string{"root", "bios", "OVMF_CODE.fd", "OVMF_VARS.fd"}

// LeaseHookFlashSpec is what a flash step flashes.
type LeaseHookFlashSpec struct {
	// Image is the OCI image to flash, with a tag or a digest
	// (registry.example/os/debian:13 or ...@sha256:<digest>), pulled as
	// the node may pull for anyone: anonymously, within the node's fetch
	// policy.
	// +kubebuilder:validation:MaxLength=512
	// +kubebuilder:validation:Pattern=`^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)*(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127}(@sha256:[a-f0-9]{64})?|@sha256:[a-f0-9]{64})$`
	Image string `json:"image"`
	// Partition is where the image's disk goes: root (default), bios,
	// OVMF_CODE.fd or OVMF_VARS.fd.
	// +optional
	// +kubebuilder:validation:Enum=root;bios;OVMF_CODE.fd;OVMF_VARS.fd
	Partition string `json:"partition,omitempty"`
}

// Bounds of an exec step's command.
const (
	// MaxLeaseHookCommandArgs bounds the arguments of a command, the
	// program included.
	MaxLeaseHookCommandArgs = 64
	// MaxLeaseHookCommandArgBytes bounds each argument, in bytes.
	MaxLeaseHookCommandArgBytes = 4096
)

// LeaseHookStep is one action of a hook, with the arguments the action
// needs: {action: powerOn}, {action: exec, command: [touch, /run/x]}.
// +kubebuilder:validation:XValidation:rule="has(self.command) == (self.action == 'exec')",message="command is set exactly when action is exec"
// +kubebuilder:validation:XValidation:rule="has(self.flash) == (self.action == 'flash')",message="flash is set exactly when action is flash"
type LeaseHookStep struct {
	// Action is what the step does: powerOn, powerOff, powerCycle, reset,
	// exec or flash.
	Action LeaseHookAction `json:"action"`
	// Command is exec's program and arguments (argv, no shell), run in the
	// guest through qemu-guest-agent; only with action exec. The guest
	// needs a running qemu-guest-agent: while a guest that is booting has
	// none answering, the step tries again within the hook's timeout.
	// +optional
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=64
	// +kubebuilder:validation:items:MinLength=1
	// +kubebuilder:validation:items:MaxLength=4096
	// +listType=atomic
	Command []string `json:"command,omitempty"`
	// Flash is flash's image and partition; only with action flash.
	// +optional
	Flash *LeaseHookFlashSpec `json:"flash,omitempty"`
}

// Check says what is wrong with the step (nil: nothing), the checks of
// the CRD's schema, for values that did not come through it (a pod's
// annotation). Pure.
func (s LeaseHookStep) Check() error {
	switch {
	case s.Action != LeaseHookExec && s.Command != nil:
		return fmt.Errorf("action %s takes no command", s.Action)
	case s.Action != LeaseHookFlash && s.Flash != nil:
		return fmt.Errorf("action %s takes no flash", s.Action)
	}
	switch s.Action {
	case LeaseHookPowerOn, LeaseHookPowerOff, LeaseHookPowerCycle, LeaseHookReset:
		return nil
	case LeaseHookExec:
		return checkCommand(s.Command)
	case LeaseHookFlash:
		return checkFlash(s.Flash)
	}
	return fmt.Errorf("action %q: want powerOn, powerOff, powerCycle, reset, exec or flash", s.Action)
}

// checkFlash checks a flash step's image and partition.
func checkFlash(f *LeaseHookFlashSpec) error {
	switch {
	case f == nil:
		return errors.New("flash: no image")
	case len(f.Image) > 512 || !leaseHookImage.MatchString(f.Image):
		return fmt.Errorf("flash: image %.80q: want an OCI reference with a tag or a digest (registry.example/os/debian:13, ...@sha256:<digest>)", f.Image)
	case f.Partition != "" && !slices.Contains(LeaseHookFlashPartitions, f.Partition):
		return fmt.Errorf("flash: partition %.40q: want one of %s", f.Partition, strings.Join(LeaseHookFlashPartitions, ", "))
	}
	return nil
}

// checkCommand checks an exec step's argv.
func checkCommand(argv []string) error {
	if len(argv) == 0 || len(argv) > MaxLeaseHookCommandArgs {
		return fmt.Errorf("exec: command has %d arguments: want 1 to %d", len(argv), MaxLeaseHookCommandArgs)
	}
	for i, a := range argv {
		switch {
		case a == "":
			return fmt.Errorf("exec: command argument %d is empty", i)
		case len(a) > MaxLeaseHookCommandArgBytes:
			return fmt.Errorf("exec: command argument %d has %d bytes: at most %d", i, len(a), MaxLeaseHookCommandArgBytes)
		case strings.ContainsRune(a, 0):
			return fmt.Errorf("exec: command argument %d contains a NUL byte", i)
		}
	}
	return nil
}

// LeaseHookOnFailure is what a failed or timed-out hook does, as
// Jumpstarter's exporter hooks define it.
// +kubebuilder:validation:Enum=warn;endLease;exit
type LeaseHookOnFailure string

const (
	// LeaseHookWarn logs the failure and goes on as if the hook succeeded.
	LeaseHookWarn LeaseHookOnFailure = "warn"
	// LeaseHookEndLease reports BEFORE_LEASE_HOOK_FAILED (the lease is
	// released, the client is never served) or AFTER_LEASE_HOOK_FAILED.
	LeaseHookEndLease LeaseHookOnFailure = "endLease"
	// LeaseHookExit reports the failed status and takes the exporter
	// offline until the pod is recreated.
	LeaseHookExit LeaseHookOnFailure = "exit"
)

// LeaseHooks are the hooks the exporter runs around each lease, as
// Jumpstarter's exporter config names them (hooks.beforeLease,
// hooks.afterLease); a hook here is a list of VM actions (a command in the
// guest among them), not a script on the node.
type LeaseHooks struct {
	// BeforeLease runs when a lease is assigned, before the client may
	// use the drivers (exporter status BEFORE_LEASE_HOOK).
	// +optional
	BeforeLease *LeaseHook `json:"beforeLease,omitempty"`
	// AfterLease runs when a lease ended, after the reset of
	// leaseStatePolicy Reset (exporter status AFTER_LEASE_HOOK).
	// +optional
	AfterLease *LeaseHook `json:"afterLease,omitempty"`
}

// LeaseHook is one lease hook.
type LeaseHook struct {
	// Actions are done in order; the first that fails fails the hook.
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=8
	// +listType=atomic
	Actions []LeaseHookStep `json:"actions"`
	// Timeout bounds the whole hook, in seconds (default 120). A hook
	// that takes longer fails.
	// +optional
	// +kubebuilder:default=120
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=3600
	Timeout int32 `json:"timeout,omitempty"`
	// OnFailure is what a failure does: warn (default), endLease or exit.
	// +optional
	// +kubebuilder:default=warn
	OnFailure LeaseHookOnFailure `json:"onFailure,omitempty"`
}
