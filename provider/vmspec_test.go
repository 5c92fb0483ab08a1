package provider

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
			spec, err := p.vmSpec(context.Background(), rec, pod, plan, &tc.img)
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
	spec, err := p.vmSpec(context.Background(), rec, pod, plan, img)
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
	spec, err := p.vmSpec(context.Background(), rec, pod, plan, img)
	require.NoError(t, err)
	assert.Contains(t, strings.Join(qemu.Args(spec), " "),
		"-append no_timer_check tsc=reliable sysctl.vm.compaction_proactiveness=0 console=ttyS0 quiet")
}
