// Package vmtest provides test fixtures for VM pods: the test OS images built
// by hack/build-test-image.sh pushed as ORAS file artifacts to a real
// docker-registry (oci/ocitest), and a reaper for QEMU processes a test
// leaves behind.
package vmtest

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// Boot markers printed on the serial console by the test images.
const (
	BootMarker      = "QK-BOOT-OK"
	PanicMarker     = "QK-PANIC-NOW"
	ArtifactType    = "application/vnd.qemu-kubelet.os-image.v1"
	PoweroffCmdline = "rdinit=/bin/busybox -- poweroff -f"
)

// Variants of the test image pushed by PushTestImages (tags of Repo).
const (
	VariantACPI   = "acpi"   // boots, prints the marker, powers off on the ACPI button
	VariantNoACPI = "noacpi" // ignores the ACPI button
	VariantPanic  = "panic"  // prints the marker and panics
)

// Repo is the repository the test images are pushed to.
const Repo = "qemu-kubelet/test-os"

// BuildTestImages runs hack/build-test-image.sh (cached) and returns the
// directory holding vmlinuz, initramfs-*.cpio.gz and cmdline.
func BuildTestImages(tb testing.TB) string {
	tb.Helper()
	return BuildTestImagesArch(tb, "")
}

// BuildTestImagesArch is BuildTestImages for a Debian architecture (amd64,
// arm64; "" the host's).
func BuildTestImagesArch(tb testing.TB, debArch string) string {
	tb.Helper()
	return BuildTestImagesKernel(tb, debArch, "")
}

// The test image's kernels (hack/build-test-image.sh's QK_TESTIMAGE_KERNEL).
const (
	// KernelDebian is Debian's cloud kernel with the modules the image
	// loads.
	KernelDebian = "debian"
	// KernelMinimal is built from Debian's kernel source with only what
	// the image uses, built in (hack/build-guest-kernel.sh; amd64).
	KernelMinimal = "minimal"
)

// BuildTestImagesKernel is BuildTestImagesArch with the image's kernel
// ("" the environment's QK_TESTIMAGE_KERNEL, else KernelDebian).
func BuildTestImagesKernel(tb testing.TB, debArch, kernel string) string {
	tb.Helper()
	testutil.SkipIfShort(tb, "QEMU test images (hack/build-test-image.sh)")
	builtMu.Lock()
	defer builtMu.Unlock()
	key := debArch + "/" + kernel
	if dir, ok := built[key]; ok {
		return dir
	}
	root := ocitest.RepoRoot(tb)
	var args []string
	if debArch != "" {
		args = append(args, debArch)
	}
	cmd := exec.Command(filepath.Join(root, "hack", "build-test-image.sh"), args...)
	if kernel != "" {
		cmd.Env = append(os.Environ(), "QK_TESTIMAGE_KERNEL="+kernel)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		tb.Fatalf("hack/build-test-image.sh: %v\n%s", err, stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	dir := strings.TrimSpace(lines[len(lines)-1])
	if kernel != "" {
		// The script falls back to Debian's kernel where the minimal one
		// is not built (arm64): a caller asking for one kernel must not
		// measure the other under its name.
		if got := imageKernel(tb, dir); got != kernel {
			tb.Fatalf("hack/build-test-image.sh %s with QK_TESTIMAGE_KERNEL=%s built an image with the %s kernel (%s)", debArch, kernel, got, dir)
		}
	}
	built[key] = dir
	return dir
}

// imageKernel is the kernel= line of the image directory's VERSION
// (KernelDebian when it has none).
func imageKernel(tb testing.TB, dir string) string {
	tb.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "VERSION"))
	if err != nil {
		tb.Fatalf("test image: %v", err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, ok := strings.CutPrefix(line, "kernel="); ok {
			return k
		}
	}
	return KernelDebian
}

// built memoizes BuildTestImagesKernel's directory by architecture and kernel for the
// test process: the script's answer does not change within a run, and each
// call costs seconds of apt-cache lookups to find that its cache is current.
var (
	builtMu sync.Mutex
	built   = map[string]string{}
)

// PushTestImages pushes the kernel + initrd variants with oras to the
// registry at addr (plain HTTP) as <addr>/<Repo>:<variant> and returns the
// references by variant.
func PushTestImages(tb testing.TB, addr string) map[string]string {
	tb.Helper()
	dir := BuildTestImages(tb)
	oras := ocitest.Oras(tb)
	refs := map[string]string{}
	for _, v := range []string{VariantACPI, VariantNoACPI, VariantPanic} {
		ref := fmt.Sprintf("%s/%s:%s", addr, Repo, v)
		// oras names layers after the files as given: run in the image dir.
		work := tb.TempDir()
		for _, f := range []string{"vmlinuz", "cmdline"} {
			if err := os.Symlink(filepath.Join(dir, f), filepath.Join(work, f)); err != nil {
				tb.Fatal(err)
			}
		}
		initrd := "initramfs-" + v + ".cpio.gz"
		if err := os.Symlink(filepath.Join(dir, initrd), filepath.Join(work, initrd)); err != nil {
			tb.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		ocitest.Run(ctx, tb, work, oras, "push", "--plain-http", "--artifact-type", ArtifactType, ref, "vmlinuz", initrd, "cmdline")
		cancel()
		refs[v] = ref
	}
	return refs
}

// PushArchVariant pushes one variant of a Debian architecture's test image
// (kernel + initrd + cmdline) as <addr>/<Repo>:<variant>-<debArch>.
func PushArchVariant(tb testing.TB, addr, debArch, variant string) string {
	tb.Helper()
	return pushVariantOf(tb, addr, BuildTestImagesArch(tb, debArch), variant+"-"+debArch, variant)
}

// PushKernelVariant pushes one variant of the host architecture's test
// image with kernel (KernelDebian, KernelMinimal) as
// <addr>/<Repo>:<variant>-<kernel>.
func PushKernelVariant(tb testing.TB, addr, kernel, variant string) string {
	tb.Helper()
	return pushVariantOf(tb, addr, BuildTestImagesKernel(tb, "", kernel), variant+"-"+kernel, variant)
}

// pushVariantOf pushes variant's kernel, initrd and cmdline from the image
// directory dir as <addr>/<Repo>:<tag>.
func pushVariantOf(tb testing.TB, addr, dir, tag, variant string) string {
	tb.Helper()
	oras := ocitest.Oras(tb)
	ref := fmt.Sprintf("%s/%s:%s", addr, Repo, tag)
	work := tb.TempDir()
	initrd := "initramfs-" + variant + ".cpio.gz"
	for _, f := range []string{"vmlinuz", initrd, "cmdline"} {
		if err := os.Symlink(filepath.Join(dir, f), filepath.Join(work, f)); err != nil {
			tb.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ocitest.Run(ctx, tb, work, oras, "push", "--plain-http", "--artifact-type", ArtifactType, ref, "vmlinuz", initrd, "cmdline")
	return ref
}

// PushIndex pushes an OCI image index as <addr>/<Repo>:<tag> listing the
// manifests of byArch (Kubernetes arch name -> reference), each with
// platform linux/<arch>: a multi-arch OS image.
func PushIndex(tb testing.TB, addr, tag string, byArch map[string]string) string {
	tb.Helper()
	oras := ocitest.Oras(tb)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var manifests []map[string]any
	for _, arch := range slices.Sorted(maps.Keys(byArch)) {
		out, err := ocitest.RunErr(ctx, "", oras, "manifest", "fetch", "--plain-http", "--descriptor", byArch[arch])
		if err != nil {
			tb.Fatalf("oras manifest fetch --descriptor %s: %v\n%s", byArch[arch], err, out)
		}
		var d map[string]any
		if err := json.Unmarshal([]byte(strings.TrimSpace(out)), &d); err != nil {
			tb.Fatalf("descriptor of %s: %v: %q", byArch[arch], err, out)
		}
		d["platform"] = map[string]string{"os": "linux", "architecture": arch}
		delete(d, "annotations")
		manifests = append(manifests, d)
	}
	idx, err := json.Marshal(map[string]any{"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": manifests})
	if err != nil {
		tb.Fatal(err)
	}
	f := filepath.Join(tb.TempDir(), "index.json")
	if err := os.WriteFile(f, idx, 0o644); err != nil {
		tb.Fatal(err)
	}
	ref := fmt.Sprintf("%s/%s:%s", addr, Repo, tag)
	ocitest.Run(ctx, tb, "", oras, "manifest", "push", "--plain-http", "--media-type", "application/vnd.oci.image.index.v1+json", ref, f)
	return ref
}

// PushVariant pushes one variant under tag with extra appended to its kernel
// command line: a different manifest and cmdline blob than PushTestImages',
// so a node that cached those still has to download this one.
func PushVariant(tb testing.TB, addr, tag, variant, extra string) string {
	tb.Helper()
	dir := BuildTestImages(tb)
	oras := ocitest.Oras(tb)
	work := tb.TempDir()
	initrd := "initramfs-" + variant + ".cpio.gz"
	for _, f := range []string{"vmlinuz", initrd} {
		if err := os.Symlink(filepath.Join(dir, f), filepath.Join(work, f)); err != nil {
			tb.Fatal(err)
		}
	}
	cmdline, err := os.ReadFile(filepath.Join(dir, "cmdline"))
	if err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(work, "cmdline"), []byte(strings.TrimSpace(string(cmdline))+" "+extra+"\n"), 0o644); err != nil {
		tb.Fatal(err)
	}
	ref := fmt.Sprintf("%s/%s:%s", addr, Repo, tag)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ocitest.Run(ctx, tb, work, oras, "push", "--plain-http", "--artifact-type", ArtifactType, ref, "vmlinuz", initrd, "cmdline")
	return ref
}

// StateCmdline, on a pod's kernel command line (annotation
// qemu-kubelet.io/kernel-cmdline) booting PushStateImage's image, has the
// guest keep a boot record on its disk: each boot prints
// "QK-STATE <token> <boots>" (the token is random, made by the guest the
// first time its disk has none); boot 1 reboots the guest, boot 2 powers
// it off, later boots stay up (hack/testimage/init.sh).
const StateCmdline = "qk.state"

// StateDiskBytes is the size of the blank disk of PushStateImage's image.
const StateDiskBytes = 2 << 20

// PushStateImage pushes variant (kernel, initrd, cmdline) with a blank
// raw disk (state.raw, StateDiskBytes) as <addr>/<Repo>:<tag>: a VM of it
// has a disk, the pod's overlay over the blank one, which the guest
// writes with StateCmdline.
func PushStateImage(tb testing.TB, addr, tag, variant string) string {
	tb.Helper()
	dir := BuildTestImages(tb)
	oras := ocitest.Oras(tb)
	work := tb.TempDir()
	initrd := "initramfs-" + variant + ".cpio.gz"
	for _, f := range []string{"vmlinuz", initrd, "cmdline"} {
		if err := os.Symlink(filepath.Join(dir, f), filepath.Join(work, f)); err != nil {
			tb.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(work, "state.raw"), make([]byte, StateDiskBytes), 0o644); err != nil {
		tb.Fatal(err)
	}
	ref := fmt.Sprintf("%s/%s:%s", addr, Repo, tag)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ocitest.Run(ctx, tb, work, oras, "push", "--plain-http", "--artifact-type", ArtifactType, ref, "vmlinuz", initrd, "cmdline", "state.raw")
	return ref
}

// QEMUPids returns the pids of qemu-system processes whose command line
// mentions dir.
func QEMUPids(dir string) []int {
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || len(b) == 0 {
			continue
		}
		args := strings.Split(string(b), "\x00")
		if !strings.Contains(filepath.Base(args[0]), "qemu-system") {
			continue
		}
		if st, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat")); err == nil {
			// zombies are gone already
			if f := strings.Fields(string(st[strings.LastIndexByte(string(st), ')')+1:])); len(f) > 0 && f[0] == "Z" {
				continue
			}
		}
		if strings.Contains(string(b), dir) {
			out = append(out, pid)
		}
	}
	return out
}

// ReapQEMU registers a cleanup that SIGKILLs every QEMU under dir and fails
// the test if any was still running (a test must stop what it starts).
func ReapQEMU(tb testing.TB, dir string) {
	tb.Helper()
	tb.Cleanup(func() {
		pids := QEMUPids(dir)
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		if len(pids) > 0 {
			tb.Errorf("QEMU processes left running under %s: %v (killed)", dir, pids)
		}
	})
}

// Diagnose describes the VM whose state is in dir, for a test that waited
// for it in vain: the QEMU processes under dir (pid, process state, CPU
// time: a paused QEMU burns none, a guest that boots over and over
// burns a lot), the exit record if one was written, and the last lines of
// the console. Small enough for a failure message.
func Diagnose(dir string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "VM state dir %s\n", dir)
	pids := QEMUPids(dir)
	if len(pids) == 0 {
		b.WriteString("QEMU: no process running\n")
	}
	for _, pid := range pids {
		fmt.Fprintf(&b, "QEMU pid %d: %s\n", pid, procSummary(pid))
	}
	if ex, err := os.ReadFile(filepath.Join(dir, qemu.ExitFileName)); err == nil {
		fmt.Fprintf(&b, "exit record %s: %s\n", qemu.ExitFileName, strings.TrimSpace(string(ex)))
	} else {
		fmt.Fprintf(&b, "exit record %s: %v\n", qemu.ExitFileName, err)
	}
	tail, err := qemu.TailConsole(dir, diagnoseConsoleLines)
	switch {
	case err != nil:
		fmt.Fprintf(&b, "console: %v\n", err)
	case len(tail) == 0:
		b.WriteString("console: empty\n")
	default:
		fmt.Fprintf(&b, "console (last %d lines):\n%s\n", diagnoseConsoleLines, strings.TrimRight(string(tail), "\n"))
	}
	return b.String()
}

// diagnoseConsoleLines is how much of the console Diagnose shows.
const diagnoseConsoleLines = 30

// procSummary is a process's state and CPU time from /proc/<pid>/stat.
func procSummary(pid int) string {
	st, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return err.Error()
	}
	s := string(st)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 13 {
		return "unreadable /proc stat: " + s
	}
	// After the comm: state is field 0, utime 11 and stime 12 (clock ticks,
	// 100 a second on Linux).
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	stt, _ := strconv.ParseInt(f[12], 10, 64)
	return fmt.Sprintf("state %s, CPU user %.1fs system %.1fs", f[0], float64(ut)/100, float64(stt)/100)
}
