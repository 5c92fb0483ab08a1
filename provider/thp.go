package provider

import (
	"fmt"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"golang.org/x/sys/unix"
)

// THPDecision is whether the VMs' QEMUs run without transparent huge
// pages, and why (for the agent's log).
type THPDecision struct {
	Disable bool
	Why     string
}

// DecideTHP resolves vmMemory.transparentHugePages against the
// accelerators of the process's nodes (the main node and its guest
// architectures; "" for a node whose probe failed, which starts no VM).
// Auto disables huge pages when the VMs run under TCG, where they do not
// speed the guest (QEMU's software TLB maps 4 KiB pages) and khugepaged
// fills again the 2 MiB ranges free page reporting split; it leaves them
// to the kernel when any node runs KVM, whose guests' speed depends on
// them (the setting is process wide). Pure.
func DecideTHP(setting string, accels []qemu.Accelerator) THPDecision {
	switch setting {
	case config.THPEnabled:
		return THPDecision{Why: "vmMemory.transparentHugePages is Enabled: the kernel's transparent_hugepage mode applies"}
	case config.THPDisabled:
		return THPDecision{Disable: true, Why: "vmMemory.transparentHugePages is Disabled"}
	}
	var tcg, kvm int
	for _, a := range accels {
		switch a {
		case qemu.AccelTCG:
			tcg++
		case qemu.AccelKVM:
			kvm++
		}
	}
	switch {
	case kvm > 0:
		return THPDecision{Why: "vmMemory.transparentHugePages is Auto and VMs run under KVM, whose guests' speed depends on huge pages: the kernel's transparent_hugepage mode applies"}
	case tcg > 0:
		return THPDecision{Disable: true, Why: "vmMemory.transparentHugePages is Auto and VMs run under TCG: huge pages do not speed an emulated guest and khugepaged would take back what free page reporting returned"}
	}
	return THPDecision{Why: "vmMemory.transparentHugePages is Auto and no accelerator is usable: no VM starts"}
}

// SetProcessTHP sets (disable) or clears PR_SET_THP_DISABLE on the
// calling process, whose children inherit it across fork and keep it
// across execve (prctl(2)): the QEMUs it starts afterwards get no
// transparent huge pages, and neither does the process's own memory (the
// flag is per process, not per child: Go's exec has no hook between fork
// and exec). Call it before any VM starts.
func SetProcessTHP(disable bool) error {
	v := 0
	if disable {
		v = 1
	}
	if err := unix.Prctl(unix.PR_SET_THP_DISABLE, uintptr(v), 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_THP_DISABLE, %d): %w", v, err)
	}
	return nil
}
