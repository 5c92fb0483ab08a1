package provider

import (
	"context"
	"net"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/guest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// Hypervisor starts and re-adopts the pods' VMs: QEMU (package qemu) on a
// node; fakes in the tests of the worker's crash, restart, delete and
// recovery paths, which then run in milliseconds with no QEMU.
type Hypervisor interface {
	// Start launches the VM of spec with its state in dir and returns
	// once it runs (ctx bounds the start only). On error no VM runs and
	// the VM is nil.
	Start(ctx context.Context, spec qemu.Spec, dir string) (VM, error)
	// Adopt re-attaches to the VM whose state is in dir (written by an
	// earlier Start, e.g. before the agent restarted): a VM still running
	// comes back running, one that ended comes back exited (Exit reports
	// how). An error means the VM cannot be supervised (unreachable or no
	// usable state): the caller deals with what is left in dir.
	Adopt(ctx context.Context, dir string) (VM, error)
}

// VM is what the provider does with one VM: the worker supervises and
// stops it, the kubelet API, probes, exporter and snapshots reach the
// guest through it. Methods are safe for concurrent use; once the VM has
// ended, the guest-side methods fail. The types are package qemu's plain
// data types.
type VM interface {
	// Exit is how the VM ended; false while it runs.
	Exit() (qemu.Exit, bool)
	// Stop ends the VM gracefully (ACPI power button, then quit after
	// opts.Grace, then kill) and cleans its state dir down to opts.Keep;
	// on an ended VM it only cleans. It returns how the VM ended.
	Stop(ctx context.Context, opts qemu.StopOptions) (qemu.Exit, error)
	// Kill ends the VM at once (classified killed); Done follows.
	Kill()
	// Detach stops supervising the VM and leaves it running, for the next
	// agent start to Adopt.
	Detach()

	// Pid is the VM's process id (QEMU's), shown in events and used to
	// tell this run's records from an earlier one's.
	Pid() int
	// StateDir is the directory given to Start or Adopt.
	StateDir() string
	// StartTimes are when the steps of the start were reached (zero
	// for an adopted VM).
	StartTimes() qemu.StartTimes
	// Stats are the VM process's CPU time and memory; an error once it
	// ended.
	Stats() (qemu.ProcStats, error)

	// The guest side: exec, port forwards, the console, QMP.
	guest.VM
	// DialDisplay is a connection to the VNC server of a VM with a
	// display (qemu.Spec.Display); an error for one without.
	DialDisplay(ctx context.Context) (net.Conn, error)
	// SaveState saves the memory and device state to path, calling
	// whileStopped with the guest paused.
	SaveState(ctx context.Context, path string, whileStopped func() error) (qemu.SavedState, error)
}

var _ VM = (*qemu.VM)(nil)

// QEMU is the Hypervisor of a node: package qemu's Start and Adopt. The
// QEMU binary, accelerator and the rest of a VM's setup come in the
// qemu.Spec (VMsConfig.QEMUBinary and others).
type QEMU struct{}

var _ Hypervisor = QEMU{}

// Start is qemu.Start.
func (QEMU) Start(ctx context.Context, spec qemu.Spec, dir string) (VM, error) {
	vm, err := qemu.Start(ctx, spec, dir)
	if err != nil {
		return nil, err // a nil VM, not a nil *qemu.VM in an interface
	}
	return vm, nil
}

// Adopt is qemu.Adopt.
func (QEMU) Adopt(ctx context.Context, dir string) (VM, error) {
	vm, err := qemu.Adopt(ctx, dir)
	if err != nil {
		return nil, err
	}
	return vm, nil
}

// ImageStore is what the pods' workers need of the node's image cache
// (*oci.Store, passed in by cmd; fakes in the fast worker tests).
type ImageStore interface {
	// Pull resolves ref and pulls it into the cache (with policy PullNever:
	// only what is cached, no registry).
	Pull(ctx context.Context, ref string, opts oci.PullOptions) (*oci.Image, error)
	// Acquire holds the image of digest dgst against GC until release.
	Acquire(dgst string) (release func(), err error)
	// AuxDir is a directory kept with the image of dgst (memory snapshots).
	AuxDir(dgst, name string) (string, error)
}

var _ ImageStore = (*oci.Store)(nil)
