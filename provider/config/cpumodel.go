package config

import (
	"strings"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

// CPUModel is the guest CPU model (QEMU's -cpu: a model, optionally with
// comma-separated features) of the node's pods that name none with the
// qemu-kubelet.io/cpu-model annotation, per accelerator, since a node
// that prefers KVM may run its VMs under either. Empty: QEMU's model of
// package qemu's choice (qemu.DefaultCPUModel: host under KVM, x86-64-v2
// under TCG). Guest-architecture nodes always use their architecture's
// default: these models are the host architecture's.
type CPUModel struct {
	// KVM is the model of VMs run under KVM (e.g. host,pmu=off).
	KVM string `json:"kvm,omitempty"`
	// TCG is the model of VMs run under TCG (e.g. max for guests built
	// for x86-64-v3). Not host: only KVM has the host's CPU.
	TCG string `json:"tcg,omitempty"`
}

// validateCPUModel checks the cpuModel section (the form of each model;
// host only for KVM) and returns the models set, by accelerator.
func validateCPUModel(c CPUModel, errs field.ErrorList) (map[qemu.Accelerator]string, field.ErrorList) {
	p := field.NewPath("cpuModel")
	var out map[qemu.Accelerator]string
	for _, m := range []struct {
		accel qemu.Accelerator
		name  string
		model string
	}{{qemu.AccelKVM, "kvm", c.KVM}, {qemu.AccelTCG, "tcg", c.TCG}} {
		if m.model == "" {
			continue
		}
		if err := qemu.ValidateCPUModel(m.model); err != nil {
			errs = append(errs, field.Invalid(p.Child(m.name), m.model, err.Error()))
			continue
		}
		if name, _, _ := strings.Cut(m.model, ","); name == "host" && m.accel != qemu.AccelKVM {
			errs = append(errs, field.Invalid(p.Child(m.name), m.model, "host needs KVM: under TCG name an emulated model (e.g. max)"))
			continue
		}
		if out == nil {
			out = map[qemu.Accelerator]string{}
		}
		out[m.accel] = m.model
	}
	return out, errs
}
