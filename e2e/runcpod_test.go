package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// podSpecContainer is a Kubernetes container as a runc bundle needs it
// (startChartAgent derives it from a pod spec).
type podSpecContainer struct {
	args, env    []string
	binds        []bind
	tmpfs        []string
	uid, gid     int64
	privileged   bool
	noNewPrivs   bool
	readOnlyRoot bool
	dropAll      bool
	addCaps      []string
	hostPID      bool
	hostNetwork  bool
}

// allCaps is what a privileged container gets.
var allCaps = []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE", "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE", "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ"}

// containerdDefaultCaps are the capabilities a container runtime grants
// when the pod drops none.
var containerdDefaultCaps = []string{"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW", "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE"}

// runPod runs container name of rootfs as s says (in the foreground of a
// `runc run` child, its own cgroup /<id>) and returns its id.
func (r *runcEnv) runPod(name, rootfs string, s podSpecContainer) string {
	t := r.t
	t.Helper()
	bundle := filepath.Join(filepath.Dir(r.root), "bundle-"+name)
	if err := os.MkdirAll(bundle, 0o700); err != nil {
		t.Fatal(err)
	}
	if b, err := exec.Command("runc", "spec", "--bundle", bundle).CombinedOutput(); err != nil {
		t.Fatalf("runc spec: %v\n%s", err, b)
	}
	var cfg map[string]any
	b, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &cfg); err != nil {
		t.Fatal(err)
	}
	proc := cfg["process"].(map[string]any)
	proc["terminal"] = false
	proc["args"] = s.args
	proc["env"] = s.env
	proc["user"] = map[string]any{"uid": s.uid, "gid": s.gid}
	proc["noNewPrivileges"] = s.noNewPrivs
	caps := containerdDefaultCaps
	switch {
	case s.privileged:
		caps = allCaps
	case s.dropAll:
		caps = s.addCaps
	default:
		caps = append(append([]string{}, caps...), s.addCaps...)
	}
	if caps == nil {
		caps = []string{}
	}
	proc["capabilities"] = map[string]any{"bounding": caps, "effective": caps, "permitted": caps}
	var nofile syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &nofile); err != nil {
		t.Fatal(err)
	}
	proc["rlimits"] = []any{map[string]any{"type": "RLIMIT_NOFILE", "hard": nofile.Max, "soft": nofile.Max}}
	cfg["root"] = map[string]any{"path": rootfs, "readonly": s.readOnlyRoot}
	cfg["hostname"] = name
	var mounts []any
	for _, m := range cfg["mounts"].([]any) {
		if m.(map[string]any)["destination"] == "/sys/fs/cgroup" {
			continue // a hostPath volume replaces it, or the container gets none
		}
		mounts = append(mounts, m)
	}
	for _, d := range s.tmpfs {
		mounts = append(mounts, map[string]any{"destination": d, "type": "tmpfs", "source": "tmpfs", "options": []string{"nosuid", "nodev", "mode=1777"}})
	}
	for _, m := range s.binds {
		opts := []string{"rbind", "nosuid", "nodev"}
		if m.ro {
			opts = append(opts, "ro")
		}
		mounts = append(mounts, map[string]any{"destination": m.dst, "type": "bind", "source": m.src, "options": opts})
	}
	cfg["mounts"] = mounts
	linux := cfg["linux"].(map[string]any)
	var nss []any
	for _, ns := range linux["namespaces"].([]any) {
		typ := ns.(map[string]any)["type"]
		if (typ == "network" && s.hostNetwork) || (typ == "pid" && s.hostPID) {
			continue
		}
		nss = append(nss, ns)
	}
	if !s.privileged {
		// containerd gives an unprivileged container a cgroup namespace of
		// its own (under cgroup v2; here on any host).
		nss = append(nss, map[string]any{"type": "cgroup"})
	}
	linux["namespaces"] = nss
	if s.privileged {
		delete(linux, "maskedPaths")
		delete(linux, "readonlyPaths")
		linux["resources"] = map[string]any{"devices": []any{map[string]any{"allow": true, "access": "rwm"}}}
	}
	if b, err = json.MarshalIndent(cfg, "", "  "); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(bundle, "config.json"), string(b))

	id := fmt.Sprintf("qk-e2e-%s-%d", name, os.Getpid())
	logPath := filepath.Join(filepath.Dir(r.root), name+".log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("runc", "--root", r.root, "run", "--bundle", bundle, id)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatalf("runc run %s: %v", name, err)
	}
	go func() { _ = cmd.Wait(); logf.Close() }()
	if r.ids == nil {
		r.ids = map[string]string{}
	}
	r.ids[name] = id
	t.Cleanup(func() {
		r.stop(id)
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			t.Logf("%s container log (tail):\n%s", name, tail(string(b), 80))
		}
	})
	if !waitFor(30*time.Second, 200*time.Millisecond, func() bool { return r.pid(id) > 0 }) {
		b, _ := os.ReadFile(logPath)
		t.Fatalf("container %s never ran:\n%s", name, tail(string(b), 30))
	}
	return id
}

// stop kills and deletes container id as a runtime removes a container:
// SIGKILL to its init, then `runc delete --force`, which (the container
// has no PID namespace of its own with hostPID) kills every process left
// in its cgroup.
func (r *runcEnv) stop(id string) {
	_ = exec.Command("runc", "--root", r.root, "kill", id, "KILL").Run()
	waitFor(10*time.Second, 100*time.Millisecond, func() bool { return r.pid(id) == 0 })
	_ = exec.Command("runc", "--root", r.root, "delete", "--force", id).Run()
}

// terminate sends SIGTERM and waits up to grace for the container's init
// to exit (the kubelet's termination), then stops it.
func (r *runcEnv) terminate(id string, grace time.Duration) {
	_ = exec.Command("runc", "--root", r.root, "kill", id, "TERM").Run()
	waitFor(grace, 200*time.Millisecond, func() bool { return r.pid(id) == 0 })
	r.stop(id)
}

// readUntilCtx reads r until want appears or ctx ends.
func readUntilCtx(ctx context.Context, r io.Reader, want string) error {
	errc := make(chan error, 1)
	go func() {
		var sb strings.Builder
		buf := make([]byte, 4096)
		for {
			n, err := r.Read(buf)
			sb.Write(buf[:n])
			if strings.Contains(sb.String(), want) {
				errc <- nil
				return
			}
			if err != nil {
				errc <- fmt.Errorf("read until %q: %w (read %q)", want, err, tail(sb.String(), 5))
				return
			}
		}
	}()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		return fmt.Errorf("read until %q: %w", want, ctx.Err())
	}
}
