package podspec

import (
	"strings"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// DefaultConsole is the kernel console added to a directly booted x86_64
// kernel's command line when neither the image nor the pod names one:
// `kubectl logs` and `kubectl attach` are the VM's first serial port
// (qemu.Spec wires it to console.log and console.sock), and a kernel
// without console= writes nothing there. Other architectures name their
// serial port differently (qemu.Arch.KernelConsole: console=ttyAMA0 on
// aarch64 virt).
const DefaultConsole = "console=ttyS0"

// KernelCmdline is the command line of a directly booted kernel of guest
// architecture arch: the image's, then the pod's annotation, with the
// architecture's console (arch.KernelConsole()) first when neither names a
// console (a console= token before any "--", after which arguments go to
// init). Pure.
func KernelCmdline(arch qemu.Arch, image, extra string) string {
	cmd := strings.TrimSpace(strings.TrimSpace(image) + " " + strings.TrimSpace(extra))
	if hasConsoleArg(cmd) {
		return cmd
	}
	return strings.TrimSpace(arch.KernelConsole() + " " + cmd)
}

// hasConsoleArg reports whether a kernel command line names a console for
// the kernel (console=..., before "--").
func hasConsoleArg(cmdline string) bool {
	for _, f := range strings.Fields(cmdline) {
		if f == "--" {
			return false
		}
		if strings.HasPrefix(f, "console=") {
			return true
		}
	}
	return false
}

// NoTimerCheck is added to an x86-64 kernel's command line under TCG: the
// kernel's boot-time check of the IO-APIC timer needs timer ticks within a
// wall-clock window that an emulated vCPU misses when the host is busy
// (a burst of guests booting, guests below other work with vmNice), and
// the boot then hangs after "..MP-BIOS bug: 8254 timer not connected to
// IO-APIC". QEMU's emulated timer is always wired; the check only costs.
const NoTimerCheck = "no_timer_check"

// EmulatedKernelCmdline is cmdline with NoTimerCheck and then idleArgs
// (the node's emulatedKernelArgs) first when the guest is an x86-64 kernel
// booted directly under TCG. An argument whose name (the part before "=")
// the command line already has before any "--" is not added: the image's
// or the pod's own choice wins. Pure.
//
// idleArgs cut what an idle emulated guest wakes up for (each wake-up of a
// TCG vCPU also wakes QEMU's main loop): tsc=reliable drops the clocksource
// watchdog (2 HPET reads and wake-ups a second; QEMU's emulated TSC follows
// the host's monotonic clock), sysctl.vm.compaction_proactiveness=0 stops
// kcompactd's proactive-compaction check (2 wake-ups a second). Measured in
// docs/performance.md, "CPU of an idle VM".
func EmulatedKernelCmdline(arch qemu.Arch, accel qemu.Accelerator, cmdline string, idleArgs []string) string {
	if arch != qemu.ArchX86_64 || accel != qemu.AccelTCG {
		return cmdline
	}
	return withArgs(cmdline, append([]string{NoTimerCheck}, idleArgs...))
}

// FreePageReportingArg asks a Linux guest to report its free memory to
// the host's free page reporting device (virtio-balloon
// free-page-reporting=on) in blocks from order 0 (4 KiB) up, instead of
// its default, the pageblock order (order 9, 2 MiB on x86-64 and arm64
// with 4 KiB pages). Memory a guest touched and freed in smaller free
// blocks (while booting: its initramfs, decompression buffers) then goes
// back to the host too. Linux 6.2 and later read it from the command line;
// 6.1's virtio_balloon sets its own order when it registers (a guest of
// 6.1 must write the order to
// /sys/module/page_reporting/parameters/page_reporting_order after the
// driver loads). Kernels without page reporting ignore it.
const FreePageReportingArg = "page_reporting.page_reporting_order=0"

// FreePageReportingCmdline is cmdline with FreePageReportingArg first
// when the VM has free page reporting (reporting), runs under TCG and the
// command line names no page_reporting.page_reporting_order before any
// "--": the image's or the pod's own order wins. Under KVM the guest keeps
// Linux's default order: a report smaller than a huge page splits the
// host's huge page backing that guest memory, and a KVM guest's speed
// depends on them; an emulated guest's does not (QEMU's software TLB maps
// 4 KiB pages either way). For a directly booted kernel of any
// architecture. Pure.
func FreePageReportingCmdline(accel qemu.Accelerator, cmdline string, reporting bool) string {
	if !reporting || accel != qemu.AccelTCG {
		return cmdline
	}
	return withArgs(cmdline, []string{FreePageReportingArg})
}

// NodeKernelCmdline is the command line the node gives a directly booted
// kernel: KernelCmdline of the image's and the pod's (extra), then
// EmulatedKernelCmdline with the node's idleArgs, then
// FreePageReportingCmdline. The one place the node's command line is
// composed (the VMs, and benchmarks that boot the node's VM bare). Pure.
func NodeKernelCmdline(arch qemu.Arch, accel qemu.Accelerator, image, extra string, idleArgs []string, freePageReporting bool) string {
	cmd := EmulatedKernelCmdline(arch, accel, KernelCmdline(arch, image, extra), idleArgs)
	return FreePageReportingCmdline(accel, cmd, freePageReporting)
}

// withArgs is cmdline with each of args first whose name (argName) the
// command line does not have before any "--", in args' order, each name
// once.
func withArgs(cmdline string, args []string) string {
	has := map[string]bool{}
	for _, f := range strings.Fields(cmdline) {
		if f == "--" {
			break
		}
		has[argName(f)] = true
	}
	var add []string
	for _, a := range args {
		if !has[argName(a)] {
			has[argName(a)] = true
			add = append(add, a)
		}
	}
	return strings.TrimSpace(strings.Join(add, " ") + " " + cmdline)
}

// argName is a kernel argument's name: the part before the first "=".
func argName(arg string) string {
	name, _, _ := strings.Cut(arg, "=")
	return name
}
