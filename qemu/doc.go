// Package qemu owns the life of one QEMU virtual machine: a validated VM spec
// turned into a QEMU command line, the supervised process (which outlives the
// caller and can be re-adopted), QMP control and events, the serial console,
// commands run in the guest through qemu-guest-agent (qga.go), guest port
// forwards, disks (overlays, scratch and config disks) and the
// accelerator (KVM/TCG) probe.
//
// It knows nothing about Kubernetes.
package qemu
