package provider

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
)

// TestVMSpecKernelConsole: the spec of a directly booted kernel whose image
// and pod name no console gets console=ttyS0 (kubectl logs is the serial
// console); one that names a console keeps it; a disk boot gets no command
// line. No QEMU is started (vmSpec of an image without a disk only plans).
func TestVMSpecKernelConsole(t *testing.T) {
	dir := t.TempDir()
	imageDir := filepath.Join(dir, "images")
	p := NewVMs(context.Background(), VMsConfig{StateDir: dir, ImageDir: imageDir, Accelerator: "tcg"})
	rec := &podVM{uid: "uid-p", dir: p.podDir("uid-p")}
	kernel := &oci.Image{Ref: "r/os:1", Digest: "sha256:x", Kernel: filepath.Join(imageDir, "k", "vmlinuz"), Initrd: filepath.Join(imageDir, "k", "initrd"), Cmdline: "quiet"}
	cases := []struct {
		name  string
		img   oci.Image
		extra string
		want  string
	}{
		// (a TCG node: the timer check goes, see TestEmulatedKernelCmdline)
		{"kernel, no console anywhere", *kernel, "loglevel=3", "no_timer_check console=ttyS0 quiet loglevel=3"},
		{"kernel, pod names the console", *kernel, "console=ttyS1", "no_timer_check quiet console=ttyS1"},
		{"kernel, image names the console", func() oci.Image { i := *kernel; i.Cmdline = "console=hvc0"; return i }(), "", "no_timer_check console=hvc0"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			pod := podtest.VMPod()
			plan, rej := podspec.Translate(pod, qemu.ArchX86_64)
			require.Nil(t, rej)
			plan.ExtraCmdline = tc.extra
			spec, err := vmSpec(vmRun{name: vmName(pod), dir: rec.dir, plan: plan}, &tc.img, p.nodeVMSettings())
			require.NoError(t, err)
			assert.Equal(t, tc.want, spec.Cmdline)
		})
	}
}

// TestVMSpecMemoryTuning: the node's memory tuning reaches every VM's spec,
// and so its QEMU command line; the pod has no say in it.
func TestVMSpecMemoryTuning(t *testing.T) {
	dir := t.TempDir()
	imageDir := filepath.Join(dir, "images")
	tuning := qemu.MemoryTuning{TCGTranslationBufferMiB: 32, FreePageReporting: true, MemMerge: true}
	p := NewVMs(context.Background(), VMsConfig{StateDir: dir, ImageDir: imageDir, Accelerator: "tcg", Memory: tuning})
	rec := &podVM{uid: "uid-m", dir: p.podDir("uid-m")}
	img := &oci.Image{Ref: "r/os:1", Digest: "sha256:x", Kernel: filepath.Join(imageDir, "k", "vmlinuz")}
	pod := podtest.VMPod()
	plan, rej := podspec.Translate(pod, qemu.ArchX86_64)
	require.Nil(t, rej)
	spec, err := vmSpec(vmRun{name: vmName(pod), dir: rec.dir, plan: plan}, img, p.nodeVMSettings())
	require.NoError(t, err)
	assert.Equal(t, tuning, spec.Memory)
	args := strings.Join(qemu.Args(spec), " ")
	for _, want := range []string{"-accel tcg,tb-size=32", "mem-merge=on", "-device virtio-balloon-pci,free-page-reporting=on"} {
		assert.Contains(t, args, want)
	}
}

// TestVMSpecEmulatedKernelArgs: the node's emulatedKernelArgs reach a
// directly booted kernel's -append on a TCG node, after no_timer_check.
func TestVMSpecEmulatedKernelArgs(t *testing.T) {
	dir := t.TempDir()
	imageDir := filepath.Join(dir, "images")
	p := NewVMs(context.Background(), VMsConfig{StateDir: dir, ImageDir: imageDir, Accelerator: "tcg",
		EmulatedKernelArgs: []string{"tsc=reliable", "sysctl.vm.compaction_proactiveness=0"}})
	rec := &podVM{uid: "uid-k", dir: p.podDir("uid-k")}
	img := &oci.Image{Ref: "r/os:1", Digest: "sha256:x", Kernel: filepath.Join(imageDir, "k", "vmlinuz"), Cmdline: "quiet"}
	pod := podtest.VMPod()
	plan, rej := podspec.Translate(pod, qemu.ArchX86_64)
	require.Nil(t, rej)
	spec, err := vmSpec(vmRun{name: vmName(pod), dir: rec.dir, plan: plan}, img, p.nodeVMSettings())
	require.NoError(t, err)
	assert.Contains(t, strings.Join(qemu.Args(spec), " "),
		"-append no_timer_check tsc=reliable sysctl.vm.compaction_proactiveness=0 console=ttyS0 quiet")
}

// TestVMSpecFreePageReportingOrder: a VM with free page reporting asks
// its directly booted guest for reports from order 0 under TCG, after the
// node's emulated arguments; the pod's own order wins; under KVM, without
// reporting, or booting a disk, nothing is added.
func TestVMSpecFreePageReportingOrder(t *testing.T) {
	dir := t.TempDir()
	imageDir := filepath.Join(dir, "images")
	kernel := &oci.Image{Ref: "r/os:1", Digest: "sha256:x", Kernel: filepath.Join(imageDir, "k", "vmlinuz"), Cmdline: "quiet"}
	disk := &oci.Image{Ref: "r/os:2", Digest: "sha256:y", Disk: filepath.Join(imageDir, "d", "disk.qcow2")}
	cases := []struct {
		name, accel, extra string
		reporting          bool
		img                *oci.Image
		want               string
	}{
		{"tcg", "tcg", "", true, kernel, "page_reporting.page_reporting_order=0 no_timer_check tsc=reliable console=ttyS0 quiet"},
		{"kvm keeps the huge-page order", "kvm", "", true, kernel, "console=ttyS0 quiet"},
		{"the pod's order", "tcg", "page_reporting.page_reporting_order=9", true, kernel, "no_timer_check tsc=reliable console=ttyS0 quiet page_reporting.page_reporting_order=9"},
		{"no reporting", "tcg", "", false, kernel, "no_timer_check tsc=reliable console=ttyS0 quiet"},
		{"a disk boot has no command line", "kvm", "", true, disk, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := NewVMs(context.Background(), VMsConfig{StateDir: dir, ImageDir: imageDir, Accelerator: tc.accel,
				Memory: qemu.MemoryTuning{FreePageReporting: tc.reporting}, EmulatedKernelArgs: []string{"tsc=reliable"}})
			pod := podtest.VMPod()
			plan, rej := podspec.Translate(pod, qemu.ArchX86_64)
			require.Nil(t, rej)
			plan.ExtraCmdline = tc.extra
			spec, err := vmSpec(vmRun{name: vmName(pod), dir: p.podDir("uid-f"), plan: plan}, tc.img, p.nodeVMSettings())
			require.NoError(t, err)
			assert.Equal(t, tc.want, spec.Cmdline)
		})
	}
}

// TestVMSpecSSHDriverCostsNothing: the exporter's default ssh child is
// only reported, and dialled on demand through a runtime forward: the
// VM's QEMU command line is the same with it on and off (no device, no
// vsock, no forward of its own).
func TestVMSpecSSHDriverCostsNothing(t *testing.T) {
	dir := t.TempDir()
	imageDir := filepath.Join(dir, "images")
	p := NewVMs(context.Background(), VMsConfig{StateDir: dir, ImageDir: imageDir, Accelerator: "tcg"})
	img := &oci.Image{Ref: "r/os:1", Digest: "sha256:x", Kernel: filepath.Join(imageDir, "k", "vmlinuz")}
	args := func(ssh v1alpha1.DriverSwitch) string {
		pod := podtest.VMPod(func(p *corev1.Pod) {
			p.Annotations = map[string]string{v1alpha1.JumpstarterSecretAnnotation: "js", v1alpha1.SSHDriverAnnotation: string(ssh)}
		})
		plan, rej := podspec.Translate(pod, qemu.ArchX86_64)
		require.Nil(t, rej)
		spec, err := vmSpec(vmRun{name: vmName(pod), dir: p.podDir(pod.UID), plan: plan}, img, p.nodeVMSettings())
		require.NoError(t, err)
		return strings.Join(qemu.Args(spec), " ")
	}
	on := args(v1alpha1.DriverEnabled)
	assert.Equal(t, args(v1alpha1.DriverDisabled), on)
	assert.NotContains(t, on, "vsock")
	assert.NotContains(t, on, "hostfwd")
}

// TestVMSpecPure: vmSpec, the VM's spec as a pure function of the run
// (plan, stored choices) and the node's settings, row by row: the memory
// is the size set through the exporter, else the pod's, computed once and
// the same in -m and the VM's cgroup; the disk is the overlay only when
// the image has one (growing it is the executor's); the pod's accelerator
// and firmware choices, a flashed firmware, and a command line no kernel
// takes (InvalidSpec). Nothing is read or written on disk (the dir does
// not exist).
func TestVMSpecPure(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "no-such-dir")
	node := nodeVMSettings{arch: qemu.ArchX86_64, accelerator: "tcg", imageDir: "/images", uefiCode: "/fw/OVMF_CODE.fd", uefiVars: "/fw/OVMF_VARS.fd"}
	cgNode := node
	cgNode.cgroup, cgNode.overhead = &qemu.Cgroup{Parent: "qk"}, 64<<20
	diskImg := &oci.Image{Ref: "r/os:1", Disk: "/images/d/disk.qcow2"}
	kernelImg := &oci.Image{Ref: "r/os:1", Kernel: "/images/k/vmlinuz", Cmdline: "console=ttyS0"}
	plan := podspec.Plan{Image: "r/os:1", CPUs: 2, MemoryMiB: 256, CPULimitMilli: 1500}
	with := func(f func(r *vmRun)) vmRun {
		r := vmRun{name: "default.vm", dir: dir, plan: plan}
		f(&r)
		return r
	}
	overlay := []qemu.Disk{{Path: filepath.Join(dir, OverlayFileName), Format: qemu.FormatQCOW2}}
	for _, tc := range []struct {
		name     string
		run      vmRun
		img      *oci.Image
		node     nodeVMSettings
		check    func(t *testing.T, s qemu.Spec)
		invalid  bool
		wantMiB  int
		wantArgs string
	}{
		{name: "the pod's memory", run: with(func(*vmRun) {}), img: diskImg, node: node, wantMiB: 256, wantArgs: "-m 256M",
			check: func(t *testing.T, s qemu.Spec) {
				assert.Equal(t, overlay, s.Disks, "the overlay, made by the executor")
				assert.Nil(t, s.Cgroup)
				assert.Equal(t, qemu.Accelerator("tcg"), s.Accelerator)
			}},
		{name: "a size set through the exporter wins", run: with(func(r *vmRun) { r.size.MemoryBytes = 512 << 20 }), img: diskImg, node: cgNode, wantMiB: 512, wantArgs: "-m 512M",
			check: func(t *testing.T, s qemu.Spec) {
				assert.Equal(t, &qemu.Cgroup{Parent: "qk", CPUMilli: 1500, MemoryMaxBytes: 512<<20 + 64<<20}, s.Cgroup, "the cgroup caps the same memory")
			}},
		{name: "an unaligned stored size rounds up once", run: with(func(r *vmRun) { r.size.MemoryBytes = 100<<20 + 1 }), img: diskImg, node: node, wantMiB: 101, wantArgs: "-m 101M"},
		{name: "a disk size is not the spec's", run: with(func(r *vmRun) { r.size.DiskBytes = 8 << 30 }), img: diskImg, node: node, wantMiB: 256,
			check: func(t *testing.T, s qemu.Spec) { assert.Equal(t, overlay, s.Disks) }},
		{name: "a kernel image has no disk", run: with(func(*vmRun) {}), img: kernelImg, node: node, wantMiB: 256,
			check: func(t *testing.T, s qemu.Spec) {
				assert.Empty(t, s.Disks)
				assert.Equal(t, "no_timer_check console=ttyS0", s.Cmdline)
			}},
		{name: "the pod's accelerator", run: with(func(r *vmRun) { r.plan.Accelerator = "kvm" }), img: diskImg, node: node, wantMiB: 256,
			check: func(t *testing.T, s qemu.Spec) { assert.Equal(t, qemu.Accelerator("kvm"), s.Accelerator) }},
		{name: "UEFI from the node", run: with(func(r *vmRun) { r.plan.Firmware = qemu.FirmwareUEFI }), img: diskImg, node: node, wantMiB: 256,
			check: func(t *testing.T, s qemu.Spec) {
				assert.Equal(t, "/fw/OVMF_CODE.fd", s.UEFICode)
				assert.Contains(t, s.AllowedDirs, "/fw")
			}},
		{name: "flashed firmware", run: with(func(r *vmRun) {
			r.flashed = map[string]podstatus.FlashedPartition{"OVMF_CODE.fd": {File: "code.fd"}}
		}), img: diskImg, node: node, wantMiB: 256,
			check: func(t *testing.T, s qemu.Spec) {
				assert.Equal(t, qemu.FirmwareUEFI, s.Firmware)
				assert.Equal(t, filepath.Join(dir, "flash", "code.fd"), s.UEFICode)
			}},
		{name: "a command line without a kernel", run: with(func(r *vmRun) { r.plan.ExtraCmdline = "quiet" }), img: diskImg, node: node, invalid: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := vmSpec(tc.run, tc.img, tc.node)
			if tc.invalid {
				_, ok := errors.AsType[podspec.InvalidSpec](err)
				assert.True(t, ok, "InvalidSpec: %v", err)
				return
			}
			require.NoError(t, err)
			again, _ := vmSpec(tc.run, tc.img, tc.node)
			assert.Equal(t, s, again, "the same run and node: the same spec")
			assert.Equal(t, tc.wantMiB, s.MemoryMiB)
			if tc.wantArgs != "" {
				assert.Contains(t, strings.Join(qemu.Args(s), " "), tc.wantArgs)
			}
			assert.Equal(t, "default.vm", s.Name)
			assert.Equal(t, dir, s.StateDir)
			if tc.check != nil {
				tc.check(t, s)
			}
			assert.NoDirExists(t, dir, "vmSpec touches no disk")
		})
	}
}
