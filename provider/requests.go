package provider

import (
	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	corev1 "k8s.io/api/core/v1"
)

// The requests the pod's exporter sends its worker (exporter.go makes
// them, power.go sends them, the worker's machine in podworker.go decides
// what each means), as plain data.

// vmOp is what a request asks of the worker.
type vmOp int

const (
	opPowerOn vmOp = iota + 1
	opPowerOff
	opFlash
	// opReset returns the VM to what the pod defines and powers it on
	// (exporter.NewReset: a flash of the pod's own definition).
	opReset
	// opResize records a size for the VM's next starts (exporter/vmsize.go).
	opResize
)

func (o vmOp) String() string {
	switch o {
	case opPowerOn:
		return "power on"
	case opPowerOff:
		return "power off"
	case opFlash:
		return "flash"
	case opReset:
		return "reset"
	case opResize:
		return "resize"
	}
	return "unknown"
}

// vmRequest is one power or flash request. reply is buffered (1): the
// worker never blocks answering, even when the caller gave up.
type vmRequest struct {
	op vmOp
	// flash (opFlash, opReset) is what to install: a pulled and verified image or
	// partition, with its hold, released by whoever ends up not using it
	// (the worker once it took the request).
	flash *exporter.Flash
	// now (opPowerOff): stop at once as upstream's QEMU power off does
	// (QEMU told to quit, killed after 5 s), not through the ACPI button.
	now bool
	// resize (opResize) is the size to check and record.
	resize *sizeChange
	reply  chan error
}

// sizeChange is a resize request's: check decides against the pod, the
// node and the other active pods' claims; change sets the new size.
type sizeChange struct {
	check  func(pod *corev1.Pod, node podspec.NodeCapacity, others []*corev1.Pod) error
	change func(*podstatus.VMSize)
}

// what names what a flash request installs.
func (r *vmRequest) what() string {
	if r.flash != nil {
		return r.flash.What()
	}
	return r.op.String()
}

// release gives up the request's hold (idempotent per request).
func (r *vmRequest) release() {
	if r.flash != nil {
		r.flash.Release()
	}
}

// refuse answers a request the worker cannot serve.
func (r *vmRequest) refuse(err error) {
	r.release()
	r.reply <- err
}

// flashVerb says what a flash or reset request does, for the power off's
// event ("to flash <what>", "to reset").
func flashVerb(r vmRequest) string {
	if r.op == opReset {
		return "reset"
	}
	return "flash " + r.what()
}
