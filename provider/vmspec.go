package provider

import (
	"fmt"
	"path/filepath"
	"strings"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
)

// The VM's spec as a pure function (vmSpec): what QEMU starts follows from
// the run (the pod's plan, the choices stored for the pod: a flashed image
// or firmware, a size set through its exporter; the image pulled for it)
// and the node's settings, and from nothing else. Each size is computed
// here, once. Readying what the spec names (the pod's guest disks, a
// memory snapshot, the overlay and its growth) are the start's executor
// steps after it (prepareRun, start.go).

// vmRun is what one run of the pod's VM boots, read once when the run
// starts (runPlan).
type vmRun struct {
	// name is the VM's QEMU-safe label (vmName).
	name string
	// dir is the pod's state dir.
	dir string
	// plan is the pod's plan (podspec.Translate) with a flashed image
	// applied (the image this run pulls).
	plan podspec.Plan
	// size is the size set through the exporter (exporter/vmsize.go; zero:
	// none): it takes the place of the plan's memory and grows the disk.
	size podstatus.VMSize
	// flashed are the partitions flashed through the exporter (firmware).
	flashed map[string]podstatus.FlashedPartition
}

// memoryMiB is the run's guest RAM: a size set through the exporter, else
// the plan's (the pod's memory). Both are whole MiB already
// (podspec.MemoryMiB rounded them).
func (r vmRun) memoryMiB() int {
	if r.size.MemoryBytes > 0 {
		return podspec.MemoryMiB(r.size.MemoryBytes)
	}
	return r.plan.MemoryMiB
}

// nodeVMSettings are the node's settings every VM of it gets, as the run
// starts (the features in force then).
type nodeVMSettings struct {
	arch        qemu.Arch
	qemuBinary  string
	accelerator string
	imageDir    string
	memory      qemu.MemoryTuning
	nice        int
	consoleCap  int64
	cgroup      *qemu.Cgroup
	overhead    int64
	runAs       *qemu.User
	uefiCode    string
	uefiVars    string
	// emulatedKernelArgs: EmulatedKernelCmdline's.
	emulatedKernelArgs []string
	// cpuModels: the node's CPU model per accelerator (podspec.CPUModel).
	cpuModels map[qemu.Accelerator]string
}

// nodeVMSettings reads the node's settings for a run starting now.
func (p *nodeWide) nodeVMSettings() nodeVMSettings {
	return nodeVMSettings{arch: p.arch(), qemuBinary: p.cfg.QEMUBinary, accelerator: p.cfg.Accelerator, imageDir: p.cfg.ImageDir,
		memory: p.cfg.Memory, nice: p.cfg.VMNice, consoleCap: p.Features().ConsoleLogSize, cgroup: p.cfg.VMCgroup,
		overhead: p.cfg.VMOverhead, runAs: p.cfg.VMUser, uefiCode: p.cfg.UEFICode, uefiVars: p.cfg.UEFIVars,
		emulatedKernelArgs: p.cfg.EmulatedKernelArgs, cpuModels: p.cfg.CPUModels}
}

// vmSpec is the spec of run r booting img on a node with settings n: its
// machine, CPUs, memory (memoryMiB) and cgroup, kernel and command line,
// firmware (a flashed one first), and the overlay as its disk when the
// image has one. The pod's guest disks and a snapshot restore are added
// by the executor (prepareRun), which then validates the whole. An
// invalid combination is a podspec.InvalidSpec. Pure.
func vmSpec(r vmRun, img *oci.Image, n nodeVMSettings) (qemu.Spec, error) {
	accel := qemu.Accelerator(n.accelerator)
	if r.plan.Accelerator != "" {
		accel = qemu.Accelerator(r.plan.Accelerator)
	}
	mem := r.memoryMiB()
	spec := qemu.Spec{
		Name:        r.name,
		Arch:        n.arch,
		QEMUBinary:  n.qemuBinary,
		Accelerator: accel,
		Machine:     r.plan.Machine,
		CPUs:        r.plan.CPUs,
		MemoryMiB:   mem,
		Firmware:    r.plan.Firmware,
		Kernel:      img.Kernel,
		Initrd:      img.Initrd,
		Cmdline:     strings.TrimSpace(img.Cmdline + " " + r.plan.ExtraCmdline),
		Network:     true,
		AllowedDirs: []string{n.imageDir},
		StateDir:    r.dir,
		Memory:      n.memory,
		Nice:        n.nice,
		Display:     r.plan.Display,
		CPUModel:    podspec.CPUModel(r.plan, accel, n.cpuModels), // the pod's, else the node's, else qemu's default
		// features.consoleLogSize in force when the VM starts.
		ConsoleCapBytes: n.consoleCap,
		Cgroup:          podspec.VMCgroup(n.cgroup, r.plan.CPULimitMilli, mem, n.overhead),
		// The node's, never the pod's (its securityContext is not read).
		RunAs: n.runAs,
	}
	if img.Kernel != "" {
		spec.Cmdline = podspec.NodeKernelCmdline(n.arch, spec.Accelerator, img.Cmdline, r.plan.ExtraCmdline, n.emulatedKernelArgs, n.memory.FreePageReporting)
	}
	if r.plan.Firmware == qemu.FirmwareUEFI {
		spec.UEFICode, spec.UEFIVarsTemplate = n.uefiCode, n.uefiVars
		spec.AllowedDirs = append(spec.AllowedDirs, filepath.Dir(n.uefiCode), filepath.Dir(n.uefiVars))
	}
	exporter.ApplyFlashedFirmware(r.dir, r.flashed, n.uefiCode, n.uefiVars, &spec)
	if img.Kernel == "" && r.plan.ExtraCmdline != "" {
		return spec, podspec.InvalidSpec{Err: fmt.Errorf("annotation %s: image %s has no kernel to pass a command line to", podspec.AnnotationKernelCmdline, r.plan.Image)}
	}
	if img.Disk != "" {
		spec.Disks = []qemu.Disk{{Path: filepath.Join(r.dir, OverlayFileName), Format: qemu.FormatQCOW2}}
	}
	return spec, nil
}

// vmName is a QEMU-safe label: namespace.name, cut to 63 characters.
func vmName(pod *corev1.Pod) string {
	n := pod.Namespace + "." + pod.Name
	if len(n) > 63 {
		n = n[:63]
	}
	return strings.TrimRight(n, ".-_")
}
