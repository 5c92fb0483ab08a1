package e2e

import (
	"bufio"
	"context"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
)

// TestQuickStart runs `make run` as the README says and then every command
// it prints, as printed (the test knows no command, only what the test OS
// image answers), in a shell with the printed exports: `kubectl scale
// exporterset/sample-pool --replicas=3` must reach 3 Ready pods on this
// (2-core) machine, the printed `kubectl run` must boot a VM whose console
// `kubectl logs -f` shows, `kubectl attach` must echo a typed line and the
// printed port-forward must serve the guest's HTTP page. Ctrl-C then stops
// everything, VMs included.
func TestQuickStart(t *testing.T) {
	testutil.SkipIfShort(t, "a control plane, a registry on 127.0.0.1:5000 and QEMU")
	if l, err := net.Listen("tcp", "127.0.0.1:5000"); err != nil {
		t.Fatalf("make run's registry needs 127.0.0.1:5000 (config/samples/exporterset.yaml points there), which is busy: %v", err)
	} else {
		l.Close()
	}
	root := ocitest.RepoRoot(t)
	tmp := t.TempDir()

	cmd := exec.Command("make", "-s", "run", "BIN="+filepath.Join(tmp, "bin"))
	cmd.Dir = root
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	pr, pw := io.Pipe()
	var outMu sync.Mutex
	var out strings.Builder
	cmd.Stdout = pw
	logf, err := os.Create(filepath.Join(tmp, "make-run.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); pw.Close(); logf.Close(); close(exited) }()
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			outMu.Lock()
			out.WriteString(sc.Text() + "\n")
			outMu.Unlock()
			if strings.HasPrefix(sc.Text(), "Press Ctrl-C") {
				close(ready)
			}
		}
	}()
	stdout := func() string { outMu.Lock(); defer outMu.Unlock(); return out.String() }
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGINT)
		select {
		case <-exited:
		case <-time.After(2 * time.Minute):
			t.Errorf("make run still running 2 minutes after Ctrl-C")
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-exited
		}
	}
	t.Cleanup(func() {
		stop()
		if t.Failed() {
			b, _ := os.ReadFile(filepath.Join(tmp, "make-run.log"))
			t.Logf("make run stdout:\n%s\nstderr (tail):\n%s", stdout(), tail(string(b), 40))
		}
	})
	select {
	case <-ready:
	case <-exited:
		t.Fatalf("make run exited before it was ready")
	case <-time.After(15 * time.Minute):
		t.Fatalf("make run not ready within 15 minutes")
	}
	printed := stdout()
	exports, cmds := parseQuickStart(printed)
	logsDir := regexp.MustCompile(`(?m)^Logs: (.+)$`).FindStringSubmatch(printed)
	if len(exports) == 0 || len(cmds) < 5 || logsDir == nil {
		t.Fatalf("make run printed no exports, commands and Logs: line:\n%s", printed)
	}
	clusterDir := filepath.Dir(logsDir[1])
	prelude := strings.Join(exports, "\n") + "\n"
	shell := func(ctx context.Context, line string) *exec.Cmd {
		c := exec.CommandContext(ctx, "bash", "-c", prelude+line)
		c.Dir = tmp
		return c
	}

	for _, pc := range cmds {
		t.Logf("$ %s", pc.cmd)
		f := strings.Fields(pc.cmd)
		switch {
		case hasWord(f, "-w") || (hasWord(f, "logs") && hasWord(f, "-f")):
			// Watches: run until the expected line shows.
			want := "Running"
			if hasWord(f, "logs") {
				want = vmtest.BootMarker
			}
			bg := startShell(t, shell, pc.cmd, nil)
			bg.waitFor(t, want, 4*time.Minute)
			bg.stop()
		case hasWord(f, "attach"):
			stdinR, stdinW := io.Pipe()
			bg := startShell(t, shell, pc.cmd, stdinR)
			done := make(chan struct{})
			go func() {
				for {
					select {
					case <-done:
						return
					case <-time.After(time.Second):
						_, _ = io.WriteString(stdinW, "qk-quickstart\n")
					}
				}
			}()
			bg.waitFor(t, "QK-ECHO: qk-quickstart", 2*time.Minute)
			close(done)
			stdinW.Close()
			bg.stop()
		case hasWord(f, "port-forward"):
			then, ok := strings.CutPrefix(pc.comment, "then: ")
			if !ok {
				t.Fatalf("%q: no `then:` command in its comment %q", pc.cmd, pc.comment)
			}
			bg := startShell(t, shell, pc.cmd, nil)
			bg.waitFor(t, "Forwarding from", time.Minute)
			t.Logf("$ %s", then)
			got, err := shell(context.Background(), then).CombinedOutput()
			if err != nil || !strings.Contains(string(got), "QK-HTTP-OK") {
				t.Errorf("%s (after %s): %v\n%s", then, pc.cmd, err, got)
			}
			bg.stop()
		default:
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			got, err := shell(ctx, pc.cmd).CombinedOutput()
			cancel()
			if err != nil {
				t.Fatalf("%s: %v\n%s", pc.cmd, err, got)
			}
			// A scale must reach its replicas, all Ready, on this node.
			if m := regexp.MustCompile(`^kubectl scale (exporterset/\S+) --replicas=(\d+)$`).FindStringSubmatch(pc.cmd); m != nil {
				var last string
				if !waitFor(6*time.Minute, 2*time.Second, func() bool {
					b, _ := shell(context.Background(), "kubectl get "+m[1]+" -o jsonpath='{.status.readyReplicas}'").Output()
					last = string(b)
					return last == m[2]
				}) {
					b, _ := shell(context.Background(), "kubectl get exportersets,pods -o wide; kubectl describe node").CombinedOutput()
					t.Fatalf("%s: %s Ready, want %s\n%s", pc.cmd, last, m[2], b)
				}
				t.Logf("%s: %s Ready", m[1], m[2])
			}
		}
	}

	stop()
	if !strings.Contains(stdout(), "local-up: stopping...") {
		t.Errorf("no `local-up: stopping...` after Ctrl-C:\n%s", stdout())
	}
	if pids := vmtest.QEMUPids(clusterDir); len(pids) != 0 {
		t.Errorf("QEMU still running under %s after Ctrl-C: %v", clusterDir, pids)
		vmtest.ReapQEMU(t, clusterDir)
	}
}

// printedCmd is one command make run printed, with its comment.
type printedCmd struct{ cmd, comment string }

// parseQuickStart returns the export lines and the other commands of
// local-up's ready text: lines indented by two spaces, `  # comment` after.
func parseQuickStart(out string) (exports []string, cmds []printedCmd) {
	_, after, ok := strings.Cut(out, "local-up: ready.")
	if !ok {
		return nil, nil
	}
	for _, l := range strings.Split(after, "\n") {
		if !strings.HasPrefix(l, "  ") {
			continue
		}
		cmd, comment, _ := strings.Cut(strings.TrimSpace(l), " # ")
		cmd = strings.TrimSpace(cmd)
		if strings.HasPrefix(cmd, "export ") {
			exports = append(exports, cmd)
			continue
		}
		cmds = append(cmds, printedCmd{cmd: cmd, comment: strings.TrimSpace(comment)})
	}
	return exports, cmds
}

func hasWord(f []string, w string) bool {
	for _, x := range f {
		if x == w {
			return true
		}
	}
	return false
}

// bgShell is a printed command left running (watch, follow, attach,
// port-forward) whose output is collected.
type bgShell struct {
	cmd    *exec.Cmd
	line   string
	mu     sync.Mutex
	out    strings.Builder
	done   chan struct{}
	cancel context.CancelFunc
}

func (b *bgShell) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.out.Write(p)
}

func (b *bgShell) output() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.out.String()
}

func startShell(t *testing.T, shell func(context.Context, string) *exec.Cmd, line string, stdin io.Reader) *bgShell {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	b := &bgShell{line: line, done: make(chan struct{}), cancel: cancel}
	b.cmd = shell(ctx, line)
	b.cmd.Stdout, b.cmd.Stderr, b.cmd.Stdin = b, b, stdin
	b.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	b.cmd.Cancel = func() error { return syscall.Kill(-b.cmd.Process.Pid, syscall.SIGKILL) }
	if err := b.cmd.Start(); err != nil {
		t.Fatalf("%s: %v", line, err)
	}
	go func() { _ = b.cmd.Wait(); close(b.done) }()
	t.Cleanup(b.stop)
	return b
}

func (b *bgShell) waitFor(t *testing.T, want string, d time.Duration) {
	t.Helper()
	if !waitFor(d, 200*time.Millisecond, func() bool {
		select {
		case <-b.done:
			return true
		default:
		}
		return strings.Contains(b.output(), want)
	}) || !strings.Contains(b.output(), want) {
		t.Fatalf("%s: no %q within %s (exited: %v):\n%s", b.line, want, d, b.exited(), tail(b.output(), 30))
	}
}

func (b *bgShell) exited() bool {
	select {
	case <-b.done:
		return true
	default:
		return false
	}
}

func (b *bgShell) stop() {
	b.cancel()
	<-b.done
}
