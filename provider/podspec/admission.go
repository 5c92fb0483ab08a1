package podspec

import (
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// Admission reasons (pod status reason, phase Failed), as a kubelet gives
// them when a pod bound to it cannot run there.
const (
	// ReasonOutOfPods: the node already runs its maxVMs.
	ReasonOutOfPods = "OutOfpods"
	// ReasonKVMUnavailable: the pod requires KVM and the node runs TCG.
	ReasonKVMUnavailable = "KVMUnavailable"
	// ReasonFirmwareUnavailable: the pod asks for UEFI and the node has no
	// OVMF firmware configured.
	ReasonFirmwareUnavailable = "FirmwareUnavailable"
)

// NodeCapacity is what admission checks a pod against.
type NodeCapacity struct {
	// Allocatable of the node (cpu, memory, ephemeral-storage, pods).
	Allocatable corev1.ResourceList
	// Accelerator the node runs VMs with: "kvm" or "tcg".
	Accelerator string
	// UEFI is true when the node has OVMF firmware configured.
	UEFI bool
	// VMOverhead is QEMU's own memory per VM (vmMemory.overhead): each VM
	// pod counts its memory request plus the larger of this and its
	// RuntimeClass overhead.
	VMOverhead resource.Quantity
}

// VMRequests is what a VM pod claims on the node: PodRequests, with the
// memory overhead raised to the node's VM overhead when the pod's own
// (RuntimeClass) overhead is smaller, so QEMU's memory is counted once,
// never twice.
func VMRequests(pod *corev1.Pod, vmOverhead resource.Quantity) corev1.ResourceList {
	out := PodRequests(pod)
	podOverhead := pod.Spec.Overhead[corev1.ResourceMemory]
	if vmOverhead.Cmp(podOverhead) > 0 {
		extra := vmOverhead.DeepCopy()
		extra.Sub(podOverhead)
		m := out[corev1.ResourceMemory]
		m.Add(extra)
		out[corev1.ResourceMemory] = m
	}
	return out
}

// PodRequests is the scheduler's view of a pod's requests: the sum of its
// containers' requests, or the largest init container's when bigger, plus
// the pod overhead (RuntimeClass).
func PodRequests(pod *corev1.Pod) corev1.ResourceList {
	out := corev1.ResourceList{}
	add := func(l corev1.ResourceList) {
		for n, q := range l {
			v := out[n]
			v.Add(q)
			out[n] = v
		}
	}
	for _, c := range pod.Spec.Containers {
		add(c.Resources.Requests)
	}
	for _, c := range pod.Spec.InitContainers {
		for n, q := range c.Resources.Requests {
			if v, ok := out[n]; !ok || q.Cmp(v) > 0 {
				out[n] = q.DeepCopy()
			}
		}
	}
	add(pod.Spec.Overhead)
	return out
}

// Admit decides, like a kubelet's admission handlers, whether a pod whose
// plan was translated fits the node next to the active (admitted, not
// terminated) pods. A nil result admits the pod. Pure.
//
// Order and reasons follow the kubelet: a requirement the node can never
// meet first (KVMUnavailable, FirmwareUnavailable), then OutOfpods, then
// OutOf<resource> for the first resource short, in the order cpu, memory,
// ephemeral-storage. Memory counts QEMU's overhead (VMRequests).
func Admit(pod *corev1.Pod, plan Plan, node NodeCapacity, active []*corev1.Pod) *Rejection {
	if plan.Accelerator == "kvm" && node.Accelerator != "kvm" {
		return &Rejection{Reason: ReasonKVMUnavailable, Message: fmt.Sprintf(
			"pod requires KVM (annotation %s=kvm) but node runs VMs with %s: KVM is not usable on this host",
			AnnotationRequireAccelerator, orNone(node.Accelerator))}
	}
	if plan.Firmware == "uefi" && !node.UEFI {
		return &Rejection{Reason: ReasonFirmwareUnavailable, Message: fmt.Sprintf(
			"pod asks for UEFI firmware (annotation %s=uefi) but the node has no OVMF firmware configured", AnnotationFirmware)}
	}
	if maxPods, ok := node.Allocatable[corev1.ResourcePods]; ok && int64(len(active))+1 > maxPods.Value() {
		return &Rejection{Reason: ReasonOutOfPods, Message: fmt.Sprintf(
			"Node didn't have enough resource: pods, requested: 1, used: %d, capacity: %d", len(active), maxPods.Value())}
	}
	want := VMRequests(pod, node.VMOverhead)
	used := corev1.ResourceList{}
	for _, p := range active {
		for n, q := range VMRequests(p, node.VMOverhead) {
			v := used[n]
			v.Add(q)
			used[n] = v
		}
	}
	for _, n := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory, corev1.ResourceEphemeralStorage} {
		w, ok := want[n]
		if !ok || w.IsZero() {
			continue
		}
		alloc, ok := node.Allocatable[n]
		if !ok {
			continue
		}
		u := used[n]
		total := u.DeepCopy()
		total.Add(w)
		if total.Cmp(alloc) > 0 {
			msg := fmt.Sprintf("Node didn't have enough resource: %s, requested: %s, used: %s, capacity: %s",
				n, amount(n, w), amount(n, u), amount(n, alloc))
			if n == corev1.ResourceMemory && !node.VMOverhead.IsZero() {
				msg += fmt.Sprintf(" (each VM counts QEMU's own memory, at least %s)", amount(n, node.VMOverhead))
			}
			return &Rejection{Reason: "OutOf" + string(n), Message: msg}
		}
	}
	return nil
}

// amount prints cpu in millicores and the rest in bytes, as the kubelet's
// admission messages do.
func amount(n corev1.ResourceName, q resource.Quantity) string {
	if n == corev1.ResourceCPU {
		return fmt.Sprint(q.MilliValue())
	}
	return fmt.Sprint(q.Value())
}

func orNone(s string) string {
	if strings.TrimSpace(s) == "" {
		return "no accelerator"
	}
	return s
}
