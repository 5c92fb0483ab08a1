package podstatus

import (
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// ConditionVMResized shows a size set through the exporter: True (reason
// Applied) once the running VM has it, False (reason PendingPowerOn) while
// it waits for the next start; the message gives the sizes.
const ConditionVMResized corev1.PodConditionType = "qemu-kubelet.io/VMResized"

// Reasons of ConditionVMResized and the resize event.
const (
	ReasonResizeApplied        = "Applied"
	ReasonResizePendingPowerOn = "PendingPowerOn"
	ReasonResized              = "Resized"
)

// VMSize is the memory and disk size set through the exporter, and what
// the current run started with. Zero means "the pod's own".
type VMSize struct {
	MemoryBytes int64 `json:"memoryBytes,omitempty"`
	DiskBytes   int64 `json:"diskBytes,omitempty"`
	// AppliedMemoryBytes and AppliedDiskBytes are the sizes the last VM
	// start used (written by the worker at the start).
	AppliedMemoryBytes int64 `json:"appliedMemoryBytes,omitempty"`
	AppliedDiskBytes   int64 `json:"appliedDiskBytes,omitempty"`
	// Changed is when a size was last set or applied.
	Changed time.Time `json:"changed,omitempty"`
}

// MemoryOrZero is the memory set (0: none); nil-safe.
func (s *VMSize) MemoryOrZero() int64 {
	if s == nil {
		return 0
	}
	return s.MemoryBytes
}

// Pending: a size was set since the VM last started.
func (s *VMSize) Pending() bool {
	return s.MemoryBytes != s.AppliedMemoryBytes || s.DiskBytes != s.AppliedDiskBytes
}

// ApplyVMSize adds ConditionVMResized to a status. Pure.
func ApplyVMSize(status *corev1.PodStatus, s *VMSize) {
	if s == nil || (s.MemoryBytes == 0 && s.DiskBytes == 0) {
		return
	}
	msg := ""
	if s.MemoryBytes > 0 {
		msg = "memory " + resource.NewQuantity(s.MemoryBytes, resource.BinarySI).String()
	}
	if s.DiskBytes > 0 {
		if msg != "" {
			msg += ", "
		}
		msg += "disk " + resource.NewQuantity(s.DiskBytes, resource.BinarySI).String()
	}
	c := corev1.PodCondition{Type: ConditionVMResized, Status: corev1.ConditionTrue, Reason: ReasonResizeApplied,
		Message: msg + " (set through the Jumpstarter exporter)", LastTransitionTime: metav1.NewTime(s.Changed)}
	if s.Pending() {
		c.Status, c.Reason = corev1.ConditionFalse, ReasonResizePendingPowerOn
		c.Message = msg + " from the next power on (set through the Jumpstarter exporter)"
	}
	status.Conditions = append(status.Conditions, c)
}
