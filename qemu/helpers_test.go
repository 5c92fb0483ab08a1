package qemu

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// testStateRoot is the prefix of every state dir this test process
// creates; TestMain checks no QEMU started with it survives the suite. It
// names the process so that a suite never takes (and kills) the VMs of
// another test process running at the same time as its own leaks.
var testStateRoot = fmt.Sprintf("/tmp/qk-qemu-test-%d-", os.Getpid())

func TestMain(m *testing.M) {
	if dir := os.Getenv(childEnv); dir != "" {
		os.Exit(childSupervisor(dir))
	}
	code := m.Run()
	if leaked := leakedQEMUs(); len(leaked) > 0 {
		fmt.Fprintf(os.Stderr, "FAIL: QEMU processes survived the test suite: %v (killed now)\n", leaked)
		for _, pid := range leaked {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		code = 1
	}
	os.Exit(code)
}

// leakedQEMUs scans /proc for QEMU processes started with a test state dir.
func leakedQEMUs() []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmd, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || !bytes.Contains(cmd, []byte("qemu-system")) || !bytes.Contains(cmd, []byte(testStateRoot)) {
			continue
		}
		if qemuAliveAny(pid) {
			pids = append(pids, pid)
		}
	}
	return pids
}

func qemuAliveAny(pid int) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(stat, ')')
	return i < 0 || i+2 >= len(stat) || (stat[i+2] != 'Z' && stat[i+2] != 'X')
}

var (
	imageMu   sync.Mutex
	imageDirs = map[string]string{} // Debian arch -> built image dir
)

// testImage builds (or finds cached) the host architecture's test OS images
// with hack/build-test-image.sh.
func testImage(t testing.TB) string {
	t.Helper()
	return testImageArch(t, HostArch().GOARCH())
}

// testImageArch builds (or finds cached) the test OS images of a Debian
// architecture (amd64, arm64).
func testImageArch(t testing.TB, debArch string) string {
	t.Helper()
	testutil.SkipIfShort(t, "QEMU and the test images")
	imageMu.Lock()
	defer imageMu.Unlock()
	if d, ok := imageDirs[debArch]; ok {
		return d
	}
	root, err := testutil.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(filepath.Join(root, "hack", "build-test-image.sh"), debArch)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("hack/build-test-image.sh %s: %v: %s", debArch, err, stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	imageDirs[debArch] = lines[len(lines)-1]
	return imageDirs[debArch]
}

// newStateDir returns a short (unix socket paths are limited) fresh dir;
// removed at cleanup.
func newStateDir(t testing.TB) string {
	t.Helper()
	d, err := os.MkdirTemp("/tmp", filepath.Base(testStateRoot)+"*")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return filepath.Join(d, "vm")
}

// testSpec is a VM booting one of the test initramfs variants.
func testSpec(t testing.TB, variant string) Spec {
	return testSpecArch(t, HostArch(), variant)
}

// testSpecArch is testSpec for a guest architecture (its own test image).
func testSpecArch(t testing.TB, arch Arch, variant string) Spec {
	img := testImageArch(t, arch.GOARCH())
	cmdline, err := os.ReadFile(filepath.Join(img, "cmdline"))
	if err != nil {
		t.Fatal(err)
	}
	return Spec{
		Name:        "test-" + variant,
		Arch:        arch,
		CPUs:        1,
		MemoryMiB:   256,
		Kernel:      filepath.Join(img, "vmlinuz"),
		Initrd:      filepath.Join(img, "initramfs-"+variant+".cpio.gz"),
		Cmdline:     strings.TrimSpace(string(cmdline)),
		AllowedDirs: []string{img},
	}
}

// startVM starts spec and makes sure QEMU is gone at cleanup, whatever
// happens.
func startVM(t testing.TB, spec Spec, stateDir string) *VM {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	vm, err := Start(ctx, spec, stateDir)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() { killVM(vm) })
	return vm
}

func killVM(vm *VM) {
	vm.Kill()
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); {
		select {
		case <-vm.Done():
			return
		case <-time.After(50 * time.Millisecond):
		}
		if !qemuAlive(vm.Pid(), vm.StateDir()) {
			return // detached VMs never report Done
		}
	}
}

const bootMarker = "QK-BOOT-OK"

func waitBoot(t testing.TB, vm *VM) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	if err := vm.WaitConsole(ctx, bootMarker); err != nil {
		b, _ := vm.Console()
		t.Fatalf("%v; console:\n%s", err, b)
	}
}

func waitExit(t testing.TB, vm *VM, d time.Duration) Exit {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	ex, err := vm.Wait(ctx)
	if err != nil {
		t.Fatalf("VM did not exit within %s: %v", d, err)
	}
	return ex
}
