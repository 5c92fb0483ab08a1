package qemu

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

const (
	childEnv     = "QK_QEMU_TEST_CHILD_STATEDIR"
	childSpecEnv = "QK_QEMU_TEST_CHILD_SPEC"
)

// childSupervisor runs in a re-executed test binary: it starts a VM, waits
// for the boot marker, reports READY and then waits to be killed.
func childSupervisor(stateDir string) int {
	var spec Spec
	if err := json.Unmarshal([]byte(os.Getenv(childSpecEnv)), &spec); err != nil {
		fmt.Println("ERROR", err)
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	vm, err := Start(ctx, spec, stateDir)
	if err != nil {
		fmt.Println("ERROR", err)
		return 2
	}
	if err := vm.WaitConsole(ctx, bootMarker); err != nil {
		fmt.Println("ERROR", err)
		return 2
	}
	fmt.Printf("READY %d\n", vm.Pid())
	select {}
}

func httpGet(t *testing.T, url string) (string, error) {
	t.Helper()
	c := http.Client{Timeout: 5 * time.Second}
	var last error
	for i := 0; i < 20; i++ {
		resp, err := c.Get(url)
		if err == nil {
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			return string(b), err
		}
		last = err
		time.Sleep(250 * time.Millisecond)
	}
	return "", last
}

func listDir(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatalf("read %s: %v", dir, err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	sort.Strings(names)
	return names
}

// TestVMLifecycle boots the ACPI-aware image with a port forward, checks the
// console, the guest HTTP server through start-time and runtime forwards,
// the interactive console, then stops it gracefully.
func TestVMLifecycle(t *testing.T) {
	spec := testSpec(t, "acpi")
	hostPort, err := FreeLoopbackPort()
	if err != nil {
		t.Fatal(err)
	}
	spec.Network = true
	spec.Forwards = []PortForward{{HostPort: hostPort, GuestPort: 8080}}
	dir := newStateDir(t)
	vm := startVM(t, spec, dir)
	events := vm.Events(context.Background())

	if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("state dir mode: %v %v", fi.Mode(), err)
	}
	if got := vm.State(); got != StateRunning {
		t.Fatalf("state after start = %s", got)
	}
	waitBoot(t, vm)
	st, err := vm.Stats()
	if err != nil || st.CPUTime <= 0 || st.RSSBytes < 64<<20 {
		t.Fatalf("stats after boot: %+v %v (a booted 256 MiB guest has used CPU and tens of MiB)", st, err)
	}

	body, err := httpGet(t, fmt.Sprintf("http://127.0.0.1:%d/", hostPort))
	if err != nil || !strings.Contains(body, "QK-HTTP-OK") {
		t.Fatalf("guest HTTP via start-time forward: %q %v", body, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rtPort, err := vm.ForwardPort(ctx, 8080, 0)
	if err != nil {
		t.Fatalf("runtime forward: %v", err)
	}
	body, err = httpGet(t, fmt.Sprintf("http://127.0.0.1:%d/", rtPort))
	if err != nil || !strings.Contains(body, "QK-HTTP-OK") {
		t.Fatalf("guest HTTP via runtime forward: %q %v", body, err)
	}
	if _, err := vm.ForwardPort(ctx, 8080, rtPort); err == nil {
		t.Fatal("forwarding an already forwarded host port must fail")
	}
	if err := vm.RemoveForward(ctx, rtPort); err != nil {
		t.Fatalf("remove forward: %v", err)
	}

	// Interactive console: typed lines are echoed by the guest to every
	// attachment at once, and the output also lands in console.log.
	conn, err := vm.AttachConsole(ctx)
	if err != nil {
		t.Fatal(err)
	}
	conn2, err := vm.AttachConsole(ctx)
	if err != nil {
		t.Fatal(err)
	}
	seen := make(chan error, 2)
	for _, c := range []io.Reader{conn, conn2} {
		go func(c io.Reader) {
			r := bufio.NewReader(c)
			for {
				line, err := r.ReadString('\n')
				if err != nil {
					seen <- fmt.Errorf("read attached console: %w", err)
					return
				}
				if strings.Contains(line, "QK-ECHO: hello-console") {
					seen <- nil
					return
				}
			}
		}(c)
	}
	if _, err := io.WriteString(conn2, "hello-console\n"); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		select {
		case err := <-seen:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("echo not seen on both attachments within 30s")
		}
	}
	conn.Close()
	conn2.Close()
	if _, err := conn2.Write([]byte("x")); err == nil {
		t.Fatal("write after close succeeded")
	}
	if err := vm.WaitConsole(ctx, "QK-ECHO: hello-console"); err != nil {
		t.Fatalf("echo not in console.log: %v", err)
	}
	tail, err := TailConsole(dir, 1)
	if err != nil || !strings.Contains(string(tail), "QK-ECHO: hello-console") || strings.Count(string(tail), "\n") > 1 {
		t.Fatalf("TailConsole(1) = %q, %v", tail, err)
	}

	ex, err := vm.Stop(ctx, StopOptions{Grace: 60 * time.Second, Keep: []string{ConsoleLogName}})
	if err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if ex.Class != ExitGuestShutdown || ex.ExitCode != 0 {
		t.Fatalf("graceful stop of the ACPI image: %+v", ex)
	}
	if got := listDir(t, dir); len(got) != 1 || got[0] != ConsoleLogName {
		t.Fatalf("state dir after Stop(Keep=console.log) holds %v", got)
	}
	b, _ := os.ReadFile(filepath.Join(dir, ConsoleLogName))
	if !strings.Contains(string(b), "QK-ACPI-POWERDOWN") {
		t.Fatalf("guest did not see the power button; console:\n%s", b)
	}
	var sawPowerdown, sawShutdown bool
	var last Event
	for ev := range events {
		switch e := ev.(type) {
		case Powerdown:
			sawPowerdown = true
		case Shutdown:
			sawShutdown = sawShutdown || (e.Guest && e.Reason == "guest-shutdown")
		}
		last = ev
	}
	if !sawPowerdown || !sawShutdown {
		t.Errorf("events: powerdown=%v guest shutdown=%v", sawPowerdown, sawShutdown)
	}
	if e, ok := last.(Exited); !ok || e.Class != ExitGuestShutdown {
		t.Errorf("last event %#v, want Exited guest-shutdown", last)
	}
	if vm.State() != StateExited {
		t.Errorf("state %s", vm.State())
	}
	if _, err := vm.Stats(); err == nil {
		t.Error("stats of an exited VM must fail")
	}
}

// TestStopIgnoredACPI: a guest that ignores the power button is quit at the
// deadline and classified killed.
func TestStopIgnoredACPI(t *testing.T) {
	dir := newStateDir(t)
	vm := startVM(t, testSpec(t, "noacpi"), dir)
	waitBoot(t, vm)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	start := time.Now()
	ex, err := vm.Stop(ctx, StopOptions{Grace: 2 * time.Second})
	if err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if ex.Class != ExitKilled || ex.ExitCode != ExitCodeKilled || !strings.Contains(ex.Reason, "did not power off within 2s") {
		t.Fatalf("exit %+v", ex)
	}
	if took := time.Since(start); took < 2*time.Second {
		t.Fatalf("stopped after %s, before the 2s deadline", took)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("state dir must be gone after Stop without Keep: %v (holds %v)", err, listDir(t, dir))
	}
}

// TestGuestPanic: the panicking image is classified panicked via pvpanic.
func TestGuestPanic(t *testing.T) {
	dir := newStateDir(t)
	vm := startVM(t, testSpec(t, "panic"), dir)
	events := vm.Events(context.Background())
	ex := waitExit(t, vm, 90*time.Second)
	if ex.Class != ExitPanicked || ex.ExitCode != ExitCodePanicked {
		b, _ := vm.Console()
		t.Fatalf("exit %+v; console:\n%s", ex, b)
	}
	var panicked bool
	for ev := range events {
		if _, ok := ev.(GuestPanicked); ok {
			panicked = true
		}
	}
	if !panicked {
		t.Error("no GuestPanicked event")
	}
	rec, err := readExit(dir)
	if err != nil || rec.Class != ExitPanicked {
		t.Fatalf("persisted exit %+v %v", rec, err)
	}
}

// TestKill9Crashed: QEMU killed behind our back is classified crashed.
func TestKill9Crashed(t *testing.T) {
	dir := newStateDir(t)
	vm := startVM(t, testSpec(t, "acpi"), dir)
	waitBoot(t, vm)
	if err := syscall.Kill(vm.Pid(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	ex := waitExit(t, vm, 30*time.Second)
	if ex.Class != ExitCrashed || ex.ExitCode != ExitCodeCrashed || !strings.Contains(ex.Reason, "signal: killed") {
		t.Fatalf("exit %+v", ex)
	}
}

// startInChild starts a VM from a re-executed test binary (the "supervisor"),
// waits for it to report the VM booted, then kills the supervisor with
// SIGKILL. Returns QEMU's pid.
func startInChild(t *testing.T, spec Spec, dir string) int {
	t.Helper()
	js, _ := json.Marshal(spec)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+dir, childSpecEnv+"="+string(js))
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		// Whatever the test did, QEMU of this state dir must go.
		if pid, err := readPidfile(dir); err == nil && qemuAlive(pid, dir) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "READY ") {
		t.Fatalf("child supervisor: %q %v", line, err)
	}
	var pid int
	fmt.Sscanf(line, "READY %d", &pid)
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	if !qemuAlive(pid, dir) {
		t.Fatalf("QEMU pid %d died with its supervisor", pid)
	}
	return pid
}

// TestReadoptAfterSupervisorDies: the VM survives its supervisor's SIGKILL,
// Adopt finds it running with its console intact, and stops it.
func TestReadoptAfterSupervisorDies(t *testing.T) {
	dir := newStateDir(t)
	spec := testSpec(t, "acpi")
	pid := startInChild(t, spec, dir)

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	vm, err := Adopt(ctx, dir)
	if err != nil {
		t.Fatalf("Adopt: %v", err)
	}
	t.Cleanup(func() { killVM(vm) })
	if vm.State() != StateRunning || vm.Pid() != pid {
		t.Fatalf("adopted state %s pid %d, want running pid %d", vm.State(), vm.Pid(), pid)
	}
	if st, err := vm.RunState(ctx); err != nil || st != "running" {
		t.Fatalf("QEMU run state %q %v", st, err)
	}
	b, err := vm.Console()
	if err != nil || !strings.Contains(string(b), bootMarker) {
		t.Fatalf("console after re-adopt lacks the marker: %v\n%s", err, b)
	}
	// The console keeps working after re-adopt.
	conn, err := vm.AttachConsole(ctx)
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(conn, "after-adopt\n")
	if err := vm.WaitConsole(ctx, "QK-ECHO: after-adopt"); err != nil {
		t.Fatal(err)
	}
	conn.Close()
	ex, err := vm.Stop(ctx, StopOptions{Grace: 60 * time.Second})
	if err != nil || ex.Class != ExitGuestShutdown {
		t.Fatalf("stop adopted VM: %+v %v", ex, err)
	}
	if qemuAlive(pid, dir) {
		t.Fatal("QEMU still alive after Stop")
	}
}

// TestAdoptDead: a VM that died while unsupervised adopts as exited.
func TestAdoptDead(t *testing.T) {
	dir := newStateDir(t)
	pid := startInChild(t, testSpec(t, "acpi"), dir)
	syscall.Kill(pid, syscall.SIGKILL)
	for i := 0; i < 200 && qemuAlive(pid, dir); i++ {
		time.Sleep(50 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	vm, err := Adopt(ctx, dir)
	if err != nil {
		t.Fatalf("Adopt: %v", err)
	}
	ex, ok := vm.Exit()
	if vm.State() != StateExited || !ok || ex.Class != ExitCrashed {
		t.Fatalf("adopt of a dead VM: state %s exit %+v", vm.State(), ex)
	}
	// A second adopt reads the persisted record.
	vm2, err := Adopt(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	if ex2, _ := vm2.Exit(); ex2.Class != ex.Class || ex2.ExitCode != ex.ExitCode || ex2.Reason != ex.Reason || !ex2.At.Equal(ex.At) {
		t.Fatalf("second adopt %+v != %+v", ex2, ex)
	}
	if _, err := Adopt(ctx, filepath.Join(dir, "nope")); err == nil {
		t.Fatal("adopting a dir without a VM must fail")
	}
}

// TestAdoptGuestShutdownWhileUnsupervised: the guest powers off while no
// supervisor runs; QEMU waits paused (-action shutdown=pause) so Adopt can
// still tell it was a guest shutdown.
func TestAdoptGuestShutdownWhileUnsupervised(t *testing.T) {
	dir := newStateDir(t)
	pid := startInChild(t, testSpec(t, "acpi"), dir)
	// Press the power button through a raw QMP connection (no supervisor).
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	raw := newVM(Spec{StateDir: dir}, dir, pid, vmLogger(ctx))
	if err := raw.connect(ctx); err != nil {
		t.Fatal(err)
	}
	go func() {
		ev, _ := raw.mon.Events(ctx)
		for range ev {
		}
	}()
	if _, err := raw.mon.Run([]byte(`{"execute":"system_powerdown"}`)); err != nil {
		t.Fatal(err)
	}
	for {
		b, err := raw.mon.Run([]byte(`{"execute":"query-status"}`))
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(b), `"shutdown"`) {
			break
		}
		if ctx.Err() != nil {
			t.Fatal("guest did not shut down")
		}
		time.Sleep(100 * time.Millisecond)
	}
	raw.mon.Disconnect()

	vm, err := Adopt(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	ex := waitExit(t, vm, 30*time.Second)
	if ex.Class != ExitGuestShutdown || ex.ExitCode != 0 {
		t.Fatalf("exit %+v", ex)
	}
}

func TestStartRejectsBadSpecAndBusyDir(t *testing.T) {
	ctx := context.Background()
	spec := testSpec(t, "acpi")
	spec.CPUs = 0
	if _, err := Start(ctx, spec, newStateDir(t)); err == nil || !strings.Contains(err.Error(), "cpus 0") {
		t.Fatalf("bad spec: %v", err)
	}
	spec = testSpec(t, "acpi")
	spec.Kernel = "/etc/passwd"
	if _, err := Start(ctx, spec, newStateDir(t)); err == nil || !strings.Contains(err.Error(), "outside the allowed dirs") {
		t.Fatalf("kernel outside allowed dirs: %v", err)
	}
	// A kernel that does not exist: refused before QEMU runs, naming it.
	spec = testSpec(t, "acpi")
	spec.Kernel = filepath.Join(filepath.Dir(spec.Kernel), "missing-vmlinuz")
	dir := newStateDir(t)
	if _, err := Start(ctx, spec, dir); err == nil || !strings.Contains(err.Error(), "kernel: stat ") || !strings.Contains(err.Error(), "missing-vmlinuz") {
		t.Fatalf("missing kernel: %v", err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("a refused start must not create the state dir: %v", err)
	}
	// A live VM in the dir is not started over.
	dir = newStateDir(t)
	startVM(t, testSpec(t, "acpi"), dir)
	if _, err := Start(ctx, testSpec(t, "acpi"), dir); err == nil || !strings.Contains(err.Error(), "still running") {
		t.Fatalf("second start in a busy dir: %v", err)
	}
}

// TestRunAs: QEMU runs as Spec.RunAs from its first instruction (real,
// effective, saved and filesystem uid and gid; no other group, no
// capability), boots from files handed to that user (kernel, initrd and a
// qcow2 disk whose backing file sits in a subdirectory of the state dir),
// serves its console and QMP to the caller, is lowered and adopted, and
// reads none of the caller's files. A file the user cannot reach is
// refused before QEMU runs, naming the directory in the way.
func TestRunAs(t *testing.T) {
	if os.Getuid() != 0 {
		t.Fatalf("this test needs root to start QEMU as another user (uid %d)", os.Getuid())
	}
	const uid, gid = 107, 108
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	spec := testSpec(t, "acpi")
	spec.RunAs = &User{UID: uid, GID: gid}
	// A kernel in a directory only root can search (the image cache is
	// under $HOME, whose mode is the caller's).
	private := t.TempDir()
	require.NoError(t, os.Chmod(private, 0o700))
	unreachable := filepath.Join(private, "vmlinuz")
	require.NoError(t, copyFile(spec.Kernel, unreachable))
	kernel := spec.Kernel
	spec.Kernel = unreachable
	spec.AllowedDirs = append(spec.AllowedDirs, private)
	spec.Nice = 10
	dir := newStateDir(t)
	if _, err := Start(ctx, spec, dir); err == nil || !errors.Is(err, errNotReachable) || !strings.Contains(err.Error(), "state dir ") ||
		!strings.Contains(err.Error(), filepath.Dir(dir)+" (mode -rwx------, owner 0:0) is not searchable by uid 107 gid 108") {
		t.Fatalf("start in a dir the user cannot reach: %v", err)
	}
	require.NoError(t, os.Chmod(filepath.Dir(dir), 0o711))
	if _, err := Start(ctx, spec, dir); err == nil || !errors.Is(err, errNotReachable) || !strings.Contains(err.Error(), "kernel: ") ||
		!strings.Contains(err.Error(), "by uid 107 gid 108") {
		t.Fatalf("start with a kernel the user cannot reach: %v", err)
	}
	spec.Kernel = kernel

	// Its own copies inside the state dir, a disk backed by a file in a
	// subdirectory (as a flashed root image is).
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "flash"), 0o700))
	for _, p := range []*string{&spec.Kernel, &spec.Initrd} {
		dst := filepath.Join(dir, filepath.Base(*p))
		require.NoError(t, copyFile(*p, dst))
		*p = dst
	}
	base := filepath.Join(dir, "flash", "base.qcow2")
	require.NoError(t, CreateScratchDisk(ctx, base, 16<<20))
	overlay := filepath.Join(dir, "disk.qcow2")
	require.NoError(t, CreateOverlay(ctx, base, FormatQCOW2, overlay, 0))
	spec.Disks = []Disk{{Path: overlay, Format: FormatQCOW2}}
	vm := startVM(t, spec, dir)
	waitBoot(t, vm)

	status := procStatus(t, vm.Pid())
	for _, want := range []string{"Uid:\t107\t107\t107\t107", "Gid:\t108\t108\t108\t108", "CapEff:\t0000000000000000",
		"CapPrm:\t0000000000000000", "CapBnd:\t0000000000000000", "CapAmb:\t0000000000000000", "NoNewPrivs:\t1", "Seccomp:\t2"} {
		if !strings.Contains(status, "\n"+want+"\n") {
			t.Errorf("QEMU's /proc/%d/status has no line %q:\n%s", vm.Pid(), want, status)
		}
	}
	if _, groups, _ := strings.Cut(status, "\nGroups:"); strings.TrimSpace(strings.SplitN(groups, "\n", 2)[0]) != "" {
		t.Errorf("QEMU has supplementary groups %q, want none (TCG: not /dev/kvm's)", strings.SplitN(groups, "\n", 2)[0])
	}
	// What the user got, and what it did not.
	owner := func(p string) (uint32, uint32, os.FileMode) {
		fi, err := os.Stat(p)
		require.NoError(t, err)
		st := fi.Sys().(*syscall.Stat_t)
		return st.Uid, st.Gid, fi.Mode()
	}
	if u, g, m := owner(dir); u != 0 || g != gid || m != os.ModeDir|os.ModeSticky|0o770 {
		t.Errorf("state dir: %d:%d %v, want 0:%d drwxrwx--T", u, g, m, gid)
	}
	if u, g, m := owner(filepath.Join(dir, "flash")); u != 0 || g != gid || m.Perm() != 0o710 {
		t.Errorf("flash dir: %d:%d %v, want 0:%d search only", u, g, m, gid)
	}
	for _, f := range []string{overlay, base, spec.Kernel, ConsoleLogName, PidfileName} {
		if u, g, _ := owner(filepath.Join(dir, strings.TrimPrefix(f, dir))); u != uid || g != gid {
			t.Errorf("%s: owner %d:%d, want the VM's %d:%d", f, u, g, uid, gid)
		}
	}
	for _, f := range []string{SpecFileName, QEMULogName} {
		if u, _, m := owner(filepath.Join(dir, f)); u != 0 || m.Perm() != 0o600 {
			t.Errorf("%s: owner %d mode %v, want the caller's 0600", f, u, m)
		}
	}
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", vm.Pid()))
	require.NoError(t, err)
	for _, f := range tasks {
		if n := threadNice(t, f); n != 10 {
			t.Errorf("%s: nice %d, want 10 (lowered though another user's)", f, n)
		}
	}

	// The console, attached through QEMU's socket, after an adoption.
	pid := vm.Pid()
	vm.Detach()
	vm2, err := Adopt(ctx, dir)
	require.NoError(t, err)
	t.Cleanup(func() { killVM(vm2) })
	if vm2.Pid() != pid || vm2.State() != StateRunning {
		t.Fatalf("adopted pid %d %s, want running %d", vm2.Pid(), vm2.State(), pid)
	}
	conn, err := vm2.AttachConsole(ctx)
	require.NoError(t, err)
	defer conn.Close()
	if _, err := io.WriteString(conn, "as-uid-107\n"); err != nil {
		t.Fatal(err)
	}
	if err := vm2.WaitConsole(ctx, "QK-ECHO: as-uid-107"); err != nil {
		t.Fatalf("console echo: %v", err)
	}
	ex, err := vm2.Stop(ctx, StopOptions{Grace: 30 * time.Second})
	if err != nil || ex.Class != ExitGuestShutdown {
		t.Fatalf("stop: %+v %v", ex, err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("state dir left behind: %v", err)
	}
}

func procStatus(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	require.NoError(t, err)
	return string(b)
}

// TestDetachAdopt: Detach leaves QEMU running; Adopt picks it up.
func TestDetachAdopt(t *testing.T) {
	dir := newStateDir(t)
	vm := startVM(t, testSpec(t, "acpi"), dir)
	pid := vm.Pid()
	vm.Detach()
	time.Sleep(500 * time.Millisecond)
	if !qemuAlive(pid, dir) {
		t.Fatal("QEMU died on Detach")
	}
	if _, exited := vm.Exit(); exited {
		t.Fatal("detached VM reports an exit")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// While a supervisor holds QMP, a second Adopt fails in time instead of
	// hanging.
	busy := startVM(t, testSpec(t, "acpi"), newStateDir(t))
	sctx, scancel := context.WithTimeout(ctx, 2*time.Second)
	if _, err := Adopt(sctx, busy.StateDir()); err == nil || !strings.Contains(err.Error(), "QMP") {
		t.Fatalf("adopt of a VM another supervisor holds: %v", err)
	}
	scancel()

	vm2, err := Adopt(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { killVM(vm2) })
	if vm2.State() != StateRunning || vm2.Pid() != pid {
		t.Fatalf("adopted %s pid %d", vm2.State(), vm2.Pid())
	}
	vm2.Kill()
	if ex := waitExit(t, vm2, 30*time.Second); ex.Class != ExitKilled {
		t.Fatalf("Kill: %+v", ex)
	}
}

// TestLeakDetector: the TestMain check finds a QEMU started with a test
// state dir (so a leak would fail the suite).
func TestLeakDetector(t *testing.T) {
	if testing.Short() {
		t.Skip("needs QEMU: skipped under -short")
	}
	dir := newStateDir(t)
	cmd := exec.Command(DefaultQEMUBinary, "-machine", "none", "-nodefaults", "-display", "none",
		"-qmp", "unix:"+filepath.Join(filepath.Dir(dir), "leak.sock")+",server=on,wait=off")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	found := false
	for i := 0; i < 100 && !found; i++ {
		for _, pid := range leakedQEMUs() {
			found = found || pid == cmd.Process.Pid
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !found {
		t.Fatal("leak detector did not find a running test QEMU")
	}
	cmd.Process.Kill()
	cmd.Wait()
	for _, pid := range leakedQEMUs() {
		if pid == cmd.Process.Pid {
			t.Fatal("reaped QEMU still reported")
		}
	}
}

// TestStopCanceledContext: a Stop whose context ends still kills QEMU and
// records the exit.
func TestStopCanceledContext(t *testing.T) {
	dir := newStateDir(t)
	vm := startVM(t, testSpec(t, "noacpi"), dir)
	waitBoot(t, vm)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	ex, err := vm.Stop(ctx, StopOptions{Grace: time.Minute})
	if err != nil || ex.Class != ExitKilled {
		t.Fatalf("Stop with short ctx: %+v %v", ex, err)
	}
	if qemuAlive(vm.Pid(), dir) {
		t.Fatal("QEMU alive after Stop")
	}
}

// TestUEFIKernelBoot boots the test kernel through OVMF (pflash code
// read-only, private vars copy in the state dir).
func TestUEFIKernelBoot(t *testing.T) {
	const code, vars = "/usr/share/OVMF/OVMF_CODE_4M.fd", "/usr/share/OVMF/OVMF_VARS_4M.fd"
	if _, err := os.Stat(code); err != nil {
		t.Fatalf("OVMF not installed (hack/install-deps.sh installs ovmf): %v", err)
	}
	spec := testSpec(t, "acpi")
	spec.Firmware = FirmwareUEFI
	spec.UEFICode, spec.UEFIVarsTemplate = code, vars
	spec.AllowedDirs = append(spec.AllowedDirs, "/usr/share/OVMF")
	dir := newStateDir(t)
	vm := startVM(t, spec, dir)
	waitBoot(t, vm)
	if fi, err := os.Stat(filepath.Join(dir, UEFIVarsName)); err != nil || fi.Size() == 0 {
		t.Fatalf("private UEFI vars: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if ex, err := vm.Stop(ctx, StopOptions{Grace: 30 * time.Second}); err != nil || ex.Class != ExitGuestShutdown {
		t.Fatalf("stop: %+v %v", ex, err)
	}
}

// TestNiceAppliesToEveryThread: with Spec.Nice, QEMU is launched paused
// and Start returns with every QEMU thread (main, vCPU, I/O) at that nice
// value and the guest running: it boots to its marker.
func TestNiceAppliesToEveryThread(t *testing.T) {
	testutil.SkipIfShort(t, "QEMU")
	spec := testSpec(t, "acpi")
	spec.Nice = 7
	vm := startVM(t, spec, newStateDir(t))
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", vm.Pid()))
	if err != nil || len(tasks) < 2 {
		t.Fatalf("threads of QEMU %d: %v %v (want the main thread and a vCPU thread at least)", vm.Pid(), tasks, err)
	}
	for _, f := range tasks {
		if n := threadNice(t, f); n != 7 {
			t.Errorf("%s: nice %d, want 7", f, n)
		}
	}
	if n := threadNice(t, "/proc/self/stat"); n != 0 {
		t.Errorf("the test process runs at nice %d: Start must change QEMU's threads only", n)
	}
	// QEMU runs in our session (so its lowered threads yield to ours under
	// scheduler autogroups too), in a process group of its own (a signal
	// to ours does not reach it), and our session was not lowered.
	if own, err := ownSession(vm.Pid()); err != nil || own {
		t.Errorf("QEMU in a session of its own: %v %v (want the caller's session)", own, err)
	}
	if pgid, err := unix.Getpgid(vm.Pid()); err != nil || pgid != vm.Pid() {
		t.Errorf("QEMU's process group %d %v, want its own (%d)", pgid, err, vm.Pid())
	}
	checkOwnAutogroupUntouched(t)
	waitBoot(t, vm)
}

// TestLowerVCPUsFirst: release's first step lowers the vCPU threads of a
// paused QEMU and leaves its main thread at the caller's priority (it
// answers the cont that follows); a process without named vCPU threads
// gets every thread lowered.
func TestLowerVCPUsFirst(t *testing.T) {
	testutil.SkipIfShort(t, "QEMU")
	spec, cmd := launchPaused(t, 6, &syscall.SysProcAttr{Setpgid: true})
	// As Start does: QMP answers a command once QEMU's init (vCPU threads
	// included) is done; the greeting comes before.
	deadline := time.Now().Add(30 * time.Second)
	var c net.Conn
	for {
		var err error
		if c, err = net.Dial("unix", spec.Path(QMPSocketName)); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("QEMU's QMP socket: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	defer c.Close()
	_ = c.SetDeadline(deadline)
	r := bufio.NewReader(c)
	if _, err := r.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(c, `{"execute":"qmp_capabilities"}`+"\n"); err != nil {
		t.Fatal(err)
	}
	if line, err := r.ReadString('\n'); err != nil || !strings.HasPrefix(line, `{"return"`) {
		t.Fatalf("qmp_capabilities: %q %v", line, err)
	}
	pid := cmd.Process.Pid
	if err := lowerVCPUs(pid, 6); err != nil {
		t.Fatal(err)
	}
	vcpus := 0
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*", pid))
	for _, task := range tasks {
		comm, err := os.ReadFile(filepath.Join(task, "comm"))
		if err != nil {
			t.Fatal(err)
		}
		want := 0
		if strings.HasPrefix(string(comm), "CPU ") {
			want = 6
			vcpus++
		}
		if n := threadNice(t, filepath.Join(task, "stat")); n != want {
			t.Errorf("QEMU thread %s (%s): nice %d, want %d", task, strings.TrimSpace(string(comm)), n, want)
		}
	}
	if vcpus != spec.CPUs {
		t.Errorf("%d vCPU threads named CPU n/..., want %d", vcpus, spec.CPUs)
	}

	sleep := exec.Command("sleep", "30")
	if err := sleep.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sleep.Process.Kill(); _ = sleep.Wait() })
	if err := lowerVCPUs(sleep.Process.Pid, 4); err != nil {
		t.Fatal(err)
	}
	if n := threadNice(t, fmt.Sprintf("/proc/%d/stat", sleep.Process.Pid)); n != 4 {
		t.Errorf("process without vCPU threads: nice %d, want 4 (all threads)", n)
	}
}

// checkAutogroupNice: on a kernel with scheduler autogroups, pid's session
// has nice value want and this process's session is untouched.
func checkAutogroupNice(t *testing.T, pid, want int) {
	t.Helper()
	if !checkOwnAutogroupUntouched(t) {
		return
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/autogroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(string(b)); !strings.HasSuffix(got, fmt.Sprintf(" nice %d", want)) {
		t.Errorf("autogroup of %d: %q, want nice %d", pid, got, want)
	}
}

// checkOwnAutogroupUntouched: this process's session was not lowered;
// false on a kernel without scheduler autogroups.
func checkOwnAutogroupUntouched(t *testing.T) bool {
	t.Helper()
	self, err := os.ReadFile("/proc/self/autogroup")
	if errors.Is(err, os.ErrNotExist) {
		t.Logf("kernel without scheduler autogroups: only the threads' nice values apply")
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	// A process of the boot session (no setsid in its ancestry, as under
	// some CI runners) is in the kernel's default autogroup, the root task
	// group, which reads as an empty file and has no nice value to lower.
	if got := strings.TrimSpace(string(self)); got != "" && !strings.HasSuffix(got, " nice 0") {
		t.Errorf("this process's autogroup: %q: only QEMU's session may be lowered", got)
	}
	return true
}

// TestSetAutogroupNice: the nice value of a process's own session is set
// (a child in a session of its own: this process's is untouched); a value
// the kernel refuses is an error naming the process.
func TestSetAutogroupNice(t *testing.T) {
	cmd := exec.Command("sleep", "30")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	if err := setAutogroupNice(cmd.Process.Pid, 9); err != nil {
		t.Fatal(err)
	}
	checkAutogroupNice(t, cmd.Process.Pid, 9)
	if err := setAutogroupNice(cmd.Process.Pid, 25); err == nil {
		t.Errorf("nice 25 accepted")
	} else if !strings.Contains(err.Error(), fmt.Sprint(cmd.Process.Pid)) {
		t.Errorf("error %q does not name the process", err)
	}
}

// threadNice reads the nice field (19th) of a /proc/.../stat file.
func threadNice(t *testing.T, statFile string) int {
	b, err := os.ReadFile(statFile)
	if err != nil {
		t.Fatal(err)
	}
	// Fields after the command name in parentheses (which may hold spaces).
	rest := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+2:]))
	n, err := strconv.Atoi(rest[16]) // field 19 overall; rest starts at field 3
	if err != nil {
		t.Fatalf("%s: nice field %q: %v", statFile, rest[16], err)
	}
	return n
}

// launchPaused starts a niced test VM's QEMU as Start launches it (paused:
// -S, spec.json written) with attr, without connecting or releasing it;
// it is killed when the test ends.
func launchPaused(t *testing.T, nice int, attr *syscall.SysProcAttr) (Spec, *exec.Cmd) {
	t.Helper()
	dir := newStateDir(t)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	spec := testSpec(t, "acpi")
	spec.Nice = nice
	spec.StateDir = dir
	spec = spec.withDefaults()
	b, _ := json.Marshal(spec)
	if err := os.WriteFile(spec.Path(SpecFileName), b, 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(spec.QEMUBinary, Args(spec)...)
	cmd.Dir = dir
	cmd.SysProcAttr = attr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return spec, cmd
}

// TestAdoptPrelaunchReleases: the supervisor died between launching a
// niced VM (paused, -S) and releasing it; Adopt finishes the start: the
// threads get the nice value and the guest boots. The VM was launched in a
// session of its own (as agents before 2026-11-25 did): Adopt lowers that
// session, not ours.
func TestAdoptPrelaunchReleases(t *testing.T) {
	testutil.SkipIfShort(t, "QEMU")
	// What Start does up to the release, then "dies".
	spec, _ := launchPaused(t, 5, &syscall.SysProcAttr{Setsid: true})
	dir := spec.StateDir
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := os.Stat(spec.Path(QMPSocketName)); err == nil {
			if _, err := readPidfile(dir); err == nil {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("QEMU did not create its QMP socket and pidfile")
		}
		time.Sleep(20 * time.Millisecond)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	vm, err := Adopt(ctx, dir)
	if err != nil {
		t.Fatalf("Adopt: %v", err)
	}
	t.Cleanup(func() { killVM(vm) })
	if st, err := vm.RunState(ctx); err != nil || st != "running" {
		t.Fatalf("run state after adopting a prelaunch VM: %q %v (want running: Adopt sends cont)", st, err)
	}
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", vm.Pid()))
	for _, f := range tasks {
		if n := threadNice(t, f); n != 5 {
			t.Errorf("%s: nice %d, want 5", f, n)
		}
	}
	checkAutogroupNice(t, vm.Pid(), 5)
	waitBoot(t, vm)
}
