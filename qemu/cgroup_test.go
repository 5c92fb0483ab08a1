package qemu

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/stretchr/testify/require"
)

func TestCgroupValidate(t *testing.T) {
	base := Spec{Name: "v", CPUs: 1, MemoryMiB: 256, Kernel: "/k/vmlinuz", AllowedDirs: []string{"/k"}, StateDir: "/var/lib/qk/vms/0c1d-uid"}
	for _, tc := range []struct {
		name string
		cg   Cgroup
		dir  string
		want string // "" = valid
	}{
		{"plain", Cgroup{Parent: "qemu-kubelet"}, "", ""},
		{"nested with limits", Cgroup{Parent: "machine/qemu-kubelet", CPUMilli: 1500, MemoryMaxBytes: 512 << 20}, "", ""},
		{"empty parent", Cgroup{}, "", "parent empty"},
		{"absolute parent", Cgroup{Parent: "/qemu-kubelet"}, "", "relative to the cgroup root"},
		{"dotdot", Cgroup{Parent: "a/../../b"}, "", "relative to the cgroup root"},
		{"interface file name", Cgroup{Parent: "memory.max"}, "", "clashes with the cgroup interface files"},
		{"odd characters", Cgroup{Parent: "qemu kubelet"}, "", "want 1-128 characters"},
		{"relative root", Cgroup{Root: "sys/fs/cgroup", Parent: "qk"}, "", "root \"sys/fs/cgroup\": must be an absolute path"},
		{"memory below the guest", Cgroup{Parent: "qk", MemoryMaxBytes: 256 << 20}, "", "at least the guest's 256 MiB plus 32 MiB"},
		{"negative cpu", Cgroup{Parent: "qk", CPUMilli: -1}, "", "cpu -1m"},
		{"tiny cpu", Cgroup{Parent: "qk", CPUMilli: 5}, "", "at least 10m"},
		{"state dir name", Cgroup{Parent: "qk"}, "/var/lib/qk/vms/cgroup.procs", "name (the state dir's base name)"},
		{"cpu only with weight", Cgroup{Parent: "qk", CPUOnly: true, ParentCPUWeight: 50}, "", ""},
		{"weight too high", Cgroup{Parent: "qk", ParentCPUWeight: 10001}, "", "parent CPU weight 10001"},
		{"negative weight", Cgroup{Parent: "qk", ParentCPUWeight: -1}, "", "parent CPU weight -1"},
		{"cpu only with a memory limit", Cgroup{Parent: "qk", CPUOnly: true, MemoryMaxBytes: 512 << 20}, "", "CPU-only cgroup has no memory controller"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := base
			cg := tc.cg
			s.Cgroup = &cg
			if tc.dir != "" {
				s.StateDir = tc.dir
			}
			err := s.Validate()
			if tc.want == "" {
				if err != nil {
					t.Fatalf("valid spec refused: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// cgroupTestRoot skips unless this process may create cgroups at the host's
// cgroup root.
func cgroupTestRoot(t *testing.T) string {
	t.Helper()
	testutil.SkipIfShort(t, "QEMU")
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates cgroups")
	}
	dirs, err := cgroupDirs(DefaultCgroupRoot, "")
	if err != nil {
		t.Skipf("no cgroup filesystem: %v", err)
	}
	probe := filepath.Join(dirs[0].path, fmt.Sprintf("qk-probe-%d", os.Getpid()))
	if err := os.Mkdir(probe, 0o755); err != nil {
		t.Skipf("cannot create cgroups under %s: %v", dirs[0].path, err)
	}
	_ = syscall.Rmdir(probe)
	return DefaultCgroupRoot
}

// startInLauncherCgroup runs the child supervisor (it starts spec and waits
// for the boot marker) in the cgroup launcher, as a container's agent runs
// in the container's cgroup, and returns QEMU's pid. The child keeps
// running.
func startInLauncherCgroup(t *testing.T, launcher []cgroupDir, spec Spec, dir string) int {
	t.Helper()
	js, _ := json.Marshal(spec)
	var join []string
	for _, d := range launcher {
		join = append(join, fmt.Sprintf("echo $$ > %s/cgroup.procs", d.path))
	}
	cmd := exec.Command("sh", "-c", strings.Join(join, " && ")+` && exec "$0" -test.run='^$'`, os.Args[0])
	cmd.Env = append(os.Environ(), childEnv+"="+dir, childSpecEnv+"="+string(js))
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		if pid, err := readPidfile(dir); err == nil && qemuAlive(pid, dir) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "READY ") {
		t.Fatalf("child supervisor: %q %v", line, err)
	}
	var pid int
	fmt.Sscanf(line, "READY %d", &pid)
	return pid
}

// TestCgroupOutlivesLauncherCgroup: the supervisor runs in a cgroup of its
// own ("the container"); one VM is started with Spec.Cgroup, one without.
// Every process of the launcher's cgroup is then SIGKILLed, as a container
// runtime stops a container: the VM in its own cgroup lives on with its
// limits, in its cgroup in every hierarchy, and is adopted; the other one
// died with the launcher. Stopping the adopted VM removes its cgroup.
func TestCgroupOutlivesLauncherCgroup(t *testing.T) {
	root := cgroupTestRoot(t)
	tag := fmt.Sprintf("qk-test-%d", os.Getpid())
	launcher, err := cgroupDirs(root, tag+"-launcher")
	if err != nil {
		t.Fatal(err)
	}
	parent := tag + "-vms"
	for _, d := range launcher {
		if err := prepareV1OrV2(root, d); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, d := range launcher {
			_ = syscall.Rmdir(d.path)
		}
		if dirs, err := cgroupDirs(root, parent); err == nil {
			for _, d := range dirs {
				_ = syscall.Rmdir(d.path)
			}
		}
	})

	own := testSpec(t, "acpi")
	own.Cgroup = &Cgroup{Parent: parent, CPUMilli: 500, MemoryMaxBytes: 768 << 20}
	ownDir := newStateDir(t)
	ownPid := startInLauncherCgroup(t, launcher, own, ownDir)
	inherit := testSpec(t, "acpi")
	inheritDir := newStateDir(t)
	inheritPid := startInLauncherCgroup(t, launcher, inherit, inheritDir)

	want := "/" + filepath.Join(parent, filepath.Base(ownDir))
	vmDirs, err := own.withStateDir(ownDir).vmCgroupDirs()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range vmDirs {
		procs, err := os.ReadFile(filepath.Join(d.path, "cgroup.procs"))
		if err != nil || !fieldsContain(string(procs), strconv.Itoa(ownPid)) {
			t.Errorf("%s/cgroup.procs %q (%v): QEMU %d not there", d.path, procs, err, ownPid)
		}
	}
	if got, err := CgroupOf(ownPid, "memory"); err == nil && got != want {
		t.Errorf("QEMU's memory cgroup %q, want %q", got, want)
	}
	for _, d := range vmDirs {
		switch {
		case d.v2 && fileExists(filepath.Join(d.path, "memory.max")):
			assertCgroupFile(t, d.path, "memory.max", strconv.Itoa(768<<20))
			assertCgroupFile(t, d.path, "cpu.max", "50000 100000")
		case d.has("memory"):
			assertCgroupFile(t, d.path, "memory.limit_in_bytes", strconv.Itoa(768<<20))
		case d.has("cpu"):
			assertCgroupFile(t, d.path, "cpu.cfs_quota_us", "50000")
		}
	}
	if got, _ := CgroupOf(inheritPid, "memory"); got != "/"+tag+"-launcher" {
		t.Errorf("QEMU without Spec.Cgroup: memory cgroup %q, want the launcher's", got)
	}

	// The runtime's stop: SIGKILL to every process of the launcher cgroup.
	for _, d := range launcher {
		b, _ := os.ReadFile(filepath.Join(d.path, "cgroup.procs"))
		for _, f := range strings.Fields(string(b)) {
			pid, _ := strconv.Atoi(f)
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for qemuAlive(inheritPid, inheritDir) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if qemuAlive(inheritPid, inheritDir) {
		t.Errorf("QEMU %d in the launcher's cgroup survived the kill of that cgroup: the test proves nothing", inheritPid)
	}
	time.Sleep(300 * time.Millisecond)
	if !qemuAlive(ownPid, ownDir) {
		t.Fatalf("QEMU %d in its own cgroup died with the launcher's cgroup", ownPid)
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	vm, err := Adopt(ctx, ownDir)
	if err != nil {
		t.Fatalf("Adopt: %v", err)
	}
	t.Cleanup(func() { killVM(vm) })
	if vm.State() != StateRunning || vm.Pid() != ownPid {
		t.Fatalf("adopted %s pid %d, want running %d", vm.State(), vm.Pid(), ownPid)
	}
	ex, err := vm.Stop(ctx, StopOptions{Grace: time.Minute})
	if err != nil || ex.Class != ExitGuestShutdown {
		t.Fatalf("stop adopted VM: %+v %v", ex, err)
	}
	for _, d := range vmDirs {
		if _, err := os.Stat(d.path); !os.IsNotExist(err) {
			t.Errorf("the VM's cgroup %s still exists after its exit (%v)", d.path, err)
		}
	}
}

func (s Spec) withStateDir(d string) Spec { s.StateDir = d; return s }

// prepareV1OrV2 makes one cgroup (the "container") in hierarchy d.
func prepareV1OrV2(root string, d cgroupDir) error {
	hier := filepath.Dir(d.path)
	if d.v2 {
		return prepareV2(hier, d.path, Cgroup{Root: root}, false)
	}
	return prepareV1(hier, d, Cgroup{Root: root})
}

func assertCgroupFile(t *testing.T, dir, name, want string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		t.Errorf("%v", err)
		return
	}
	if got := strings.TrimSpace(string(b)); got != want {
		t.Errorf("%s/%s = %q, want %q", dir, name, got, want)
	}
}

// TestStartInCgroupNamespace: a process started for Cgroup.Namespace runs
// in that cgroup namespace (here one of a process made with unshare -C),
// and the caller's own threads stay in theirs.
func TestStartInCgroupNamespace(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: joins a cgroup namespace")
	}
	other := exec.Command("unshare", "-C", "sleep", "60")
	if err := other.Start(); err != nil {
		t.Skipf("unshare -C: %v", err)
	}
	t.Cleanup(func() { _ = other.Process.Kill(); _ = other.Wait() })
	ns := fmt.Sprintf("/proc/%d/ns/cgroup", other.Process.Pid)
	var want string
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		self, _ := os.Readlink("/proc/self/ns/cgroup")
		if w, err := os.Readlink(ns); err == nil && w != self {
			want = w
			break
		}
	}
	if want == "" {
		t.Fatal("unshare -C never ran in a cgroup namespace of its own")
	}
	var out strings.Builder
	cmd := exec.Command("readlink", "/proc/self/ns/cgroup")
	cmd.Stdout = &out
	if err := startIn(cmd, ns, false); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(out.String()); got != want {
		t.Errorf("started in cgroup namespace %q, want %q", got, want)
	}
	mine, _ := os.Readlink("/proc/self/ns/cgroup")
	if mine == want {
		t.Errorf("the caller joined the other namespace too (%s)", mine)
	}
	if err := startIn(exec.Command("true"), "/nonexistent/ns", false); err == nil || !strings.Contains(err.Error(), "/nonexistent/ns") {
		t.Errorf("missing namespace file: %v", err)
	}
}

// TestStartConfinedDropsCapabilities: a program started by a root caller
// with capabilities holds none (so QEMU never does), the caller keeps its.
func TestStartConfinedDropsCapabilities(t *testing.T) {
	if os.Geteuid() != 0 || !threadHasCaps() {
		t.Skip("needs root with capabilities")
	}
	var out strings.Builder
	cmd := exec.Command("grep", "^Cap", "/proc/self/status")
	cmd.Stdout = &out
	if err := startConfined(cmd, "", false); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		f := strings.Fields(l)
		if len(f) != 2 || strings.Trim(f[1], "0") != "" {
			t.Errorf("started program: %q, want no capability", l)
		}
	}
	if !strings.Contains(out.String(), "CapBnd:") {
		t.Fatalf("no capability lines read: %q", out.String())
	}
	if !threadHasCaps() {
		t.Error("the caller lost its capabilities")
	}
}

func TestNSDelegate(t *testing.T) {
	for _, tc := range []struct {
		mi   string
		want bool
	}{
		{"35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot", true},
		{"41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n42 31 0:39 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory", false},
		{"36 25 0:31 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,nsdelegate", false},
		{"", false},
	} {
		if got := nsDelegate(tc.mi); got != tc.want {
			t.Errorf("nsDelegate(%q) = %v, want %v", tc.mi, got, tc.want)
		}
	}
}

// cgroup2Mount returns a cgroup2 mount point this process may create
// cgroups in: /sys/fs/cgroup on a unified host, /sys/fs/cgroup/unified in
// the hybrid layout. It skips the test when there is none.
func cgroup2Mount(t *testing.T) string {
	t.Helper()
	testutil.SkipIfShort(t, "QEMU")
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates cgroups")
	}
	for _, l := range strings.Split(mountinfo(), "\n") {
		pre, post, ok := strings.Cut(l, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if !ok || len(f) < 5 || len(g) < 1 || g[0] != "cgroup2" {
			continue
		}
		probe := filepath.Join(f[4], fmt.Sprintf("qk-probe-%d", os.Getpid()))
		if err := os.Mkdir(probe, 0o755); err != nil {
			t.Logf("cgroup2 at %s: cannot create cgroups: %v", f[4], err)
			continue
		}
		_ = syscall.Rmdir(probe)
		return f[4]
	}
	t.Skip("no writable cgroup2 mount")
	return ""
}

// TestCgroupV2: the cgroup v2 path against the host's cgroup2 mount (its
// root, whatever the layout). QEMU is forked straight into its cgroup
// (CLONE_INTO_CGROUP: one hierarchy, a directory fd), outlives the kill of
// its launcher's cgroup, is found there again by Adopt and the cgroup goes
// with its exit. A limit whose controller the hierarchy lacks (the hybrid
// layout's unified hierarchy carries none) fails the start, naming it, and
// leaves no cgroup behind; where the controllers are there the limits are
// written.
func TestCgroupV2(t *testing.T) {
	root := cgroup2Mount(t)
	tag := fmt.Sprintf("qk-v2-%d", os.Getpid())
	launcher, err := cgroupDirs(root, tag+"-launcher")
	require.NoError(t, err)
	require.Len(t, launcher, 1)
	require.True(t, launcher[0].v2, "%s is a cgroup2 mount", root)
	parent := tag + "-vms"
	require.NoError(t, os.Mkdir(launcher[0].path, 0o755))
	t.Cleanup(func() {
		_ = syscall.Rmdir(launcher[0].path)
		_ = syscall.Rmdir(filepath.Join(root, parent))
	})
	avail, err := os.ReadFile(filepath.Join(root, "cgroup.controllers"))
	require.NoError(t, err)
	limits := fieldsContain(string(avail), "cpu") && fieldsContain(string(avail), "memory")

	spec := testSpec(t, "acpi")
	spec.Cgroup = &Cgroup{Root: root, Parent: parent, CPUMilli: 500, MemoryMaxBytes: 768 << 20}
	if !limits {
		// The hybrid layout: cpu and memory are v1's.
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		dir := newStateDir(t)
		_, err := Start(ctx, spec, dir)
		cancel()
		if err == nil || !strings.Contains(err.Error(), "controller cpu not available in "+root) {
			t.Fatalf("limits without their controllers: %v", err)
		}
		if _, err := os.Stat(filepath.Join(root, parent, filepath.Base(dir))); !os.IsNotExist(err) {
			t.Errorf("the failed start left its cgroup: %v", err)
		}
		t.Logf("%s has controllers %q: limits not testable here, only their refusal", root, strings.TrimSpace(string(avail)))
		spec.Cgroup.CPUMilli, spec.Cgroup.MemoryMaxBytes = 0, 0
	}
	dir := newStateDir(t)
	dirs, err := spec.withStateDir(dir).vmCgroupDirs()
	require.NoError(t, err)
	require.Len(t, dirs, 1)
	fd, err := openCgroupV2([]cgroupDir{{path: root, v2: true}})
	require.NoError(t, err)
	require.GreaterOrEqual(t, fd, 0, "a cgroup2 root forks QEMU into its cgroup")
	syscall.Close(fd)

	pid := startInLauncherCgroup(t, launcher, spec, dir)
	want := "/" + filepath.Join(parent, filepath.Base(dir))
	got, err := CgroupOf(pid, "")
	require.NoError(t, err)
	require.Equal(t, want, got, "QEMU's cgroup in the unified hierarchy")
	procs, err := os.ReadFile(filepath.Join(dirs[0].path, "cgroup.procs"))
	require.NoError(t, err)
	require.True(t, fieldsContain(string(procs), strconv.Itoa(pid)), "QEMU %d in %s/cgroup.procs: %q", pid, dirs[0].path, procs)
	if limits {
		assertCgroupFile(t, dirs[0].path, "memory.max", strconv.Itoa(768<<20))
		assertCgroupFile(t, dirs[0].path, "cpu.max", "50000 100000")
	}

	// The launcher's cgroup is killed (a container runtime's stop).
	b, _ := os.ReadFile(filepath.Join(launcher[0].path, "cgroup.procs"))
	require.NotEmpty(t, strings.Fields(string(b)), "the supervisor runs in the launcher's cgroup")
	for _, f := range strings.Fields(string(b)) {
		p, _ := strconv.Atoi(f)
		require.NotEqual(t, pid, p, "QEMU is not in its launcher's cgroup")
		_ = syscall.Kill(p, syscall.SIGKILL)
	}
	time.Sleep(500 * time.Millisecond)
	require.True(t, qemuAlive(pid, dir), "QEMU %d died with its launcher's cgroup", pid)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	vm, err := Adopt(ctx, dir)
	require.NoError(t, err)
	t.Cleanup(func() { killVM(vm) })
	require.Equal(t, pid, vm.Pid())
	require.Equal(t, StateRunning, vm.State())
	got, err = CgroupOf(vm.Pid(), "")
	require.NoError(t, err)
	require.Equal(t, want, got, "the adopted QEMU is in its cgroup")
	ex, err := vm.Stop(ctx, StopOptions{Grace: time.Minute})
	if err != nil || ex.Class != ExitGuestShutdown {
		t.Fatalf("stop adopted VM: %+v %v", ex, err)
	}
	if _, err := os.Stat(dirs[0].path); !os.IsNotExist(err) {
		t.Errorf("the VM's cgroup %s still exists after its exit (%v)", dirs[0].path, err)
	}
}
