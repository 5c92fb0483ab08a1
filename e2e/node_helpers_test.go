package e2e

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// buildQemuKubelet puts ./cmd/qemu-kubelet (version kubeletVersion, built
// once per test process) into a test temp dir.
func buildQemuKubelet(t *testing.T) string {
	t.Helper()
	root, err := cluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	return goBuild(t, root, t.TempDir(), kubeletPkg)
}

// nodeAgent is one qemu-kubelet process under test, restartable with the
// same config and state directory.
type nodeAgent struct {
	t          *testing.T
	bin        string
	name       string
	port       int
	ip         string
	dir        string
	configPath string
	kubeconfig string
	logPath    string
	netns      string // when set, the agent runs in this network namespace (ip netns exec)

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// newNodeAgent writes a config for node name (accelerator policy as given,
// extra YAML appended) and returns the agent, not started. It is stopped
// with SIGKILL (whole process group) when the test ends.
func newNodeAgent(t *testing.T, c *cluster.Cluster, bin, name, policy, extra string) *nodeAgent {
	t.Helper()
	dir := testutil.Searchable(t, t.TempDir()) // QEMU runs as vmUser 107
	kc, err := c.NodeKubeconfig(name)
	if err != nil {
		t.Fatal(err)
	}
	a := &nodeAgent{t: t, bin: bin, name: name, port: testutil.FreePort(t), ip: testutil.HostIPv4(t), dir: dir, kubeconfig: kc,
		configPath: filepath.Join(dir, "node.yaml"), logPath: filepath.Join(dir, "qemu-kubelet.log")}
	cfg := fmt.Sprintf(`apiVersion: qemu-kubelet.io/v1alpha1
kind: NodeConfiguration
nodeName: %s
nodeIP: %s
stateDir: %s
maxVMs: 7
reserved: {cpu: 100m, memory: 256Mi, ephemeral-storage: 1Gi}
accelerator: {policy: %s, probeTimeout: 20s}
server: {address: %s, port: %d, clientCAFile: %s}
nodeStatusUpdateFrequency: 2s
nodeLeaseDurationSeconds: 12
%s`, name, a.ip, filepath.Join(dir, "state"), policy, a.ip, a.port, c.CAFile(), extra)
	if err := os.WriteFile(a.configPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		a.kill(syscall.SIGKILL)
		if t.Failed() {
			b, _ := os.ReadFile(a.logPath)
			t.Logf("qemu-kubelet %s log (tail):\n%s", name, tail(string(b), 60))
		}
	})
	return a
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func (a *nodeAgent) start() {
	a.t.Helper()
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.cmd != nil {
		select {
		case <-a.done:
		default:
			a.t.Fatalf("qemu-kubelet %s already running", a.name)
		}
	}
	logf, err := os.OpenFile(a.logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		a.t.Fatal(err)
	}
	name, args := a.bin, []string{"--config", a.configPath, "--kubeconfig", a.kubeconfig, "-v", "2"}
	if a.netns != "" {
		// ip execs the agent after entering the namespace: same pid.
		name, args = "ip", append([]string{"netns", "exec", a.netns, a.bin}, args...)
	}
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		a.t.Fatalf("start qemu-kubelet: %v", err)
	}
	done := make(chan struct{})
	a.cmd, a.done = cmd, done
	go func() {
		err := cmd.Wait()
		logf.Close()
		a.mu.Lock()
		a.err = err
		a.mu.Unlock()
		close(done)
	}()
}

// kill signals the process group and waits for the process to exit
// (SIGKILL after 15s). It returns the process's exit error.
func (a *nodeAgent) kill(sig syscall.Signal) error {
	a.mu.Lock()
	cmd, done := a.cmd, a.done
	a.mu.Unlock()
	if cmd == nil {
		return nil
	}
	_ = syscall.Kill(-cmd.Process.Pid, sig)
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.err
}

// kubeletTLS returns a client TLS config trusting this node's generated
// self-signed serving certificate, presenting the client cert of
// kubeconfig (if any).
func (a *nodeAgent) kubeletTLS(t *testing.T, kubeconfig string) *tls.Config {
	t.Helper()
	pem, err := os.ReadFile(filepath.Join(a.dir, "state", "pki", "kubelet.crt"))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		t.Fatal("bad kubelet serving cert")
	}
	cfg := &tls.Config{RootCAs: pool, ServerName: a.ip}
	if kubeconfig != "" {
		rc, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
		if err != nil {
			t.Fatal(err)
		}
		cert, err := tls.X509KeyPair(rc.CertData, rc.KeyData)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg
}

// kubeletGet does a GET on the kubelet API directly and returns the status
// code and body.
func (a *nodeAgent) kubeletGet(t *testing.T, path string, tlsCfg *tls.Config, bearer string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, fmt.Sprintf("https://%s%s", net.JoinHostPort(a.ip, fmt.Sprint(a.port)), path), nil)
	if err != nil {
		t.Fatal(err)
	}
	if bearer != "" {
		req.Header.Set("Authorization", "Bearer "+bearer)
	}
	cl := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{TLSClientConfig: tlsCfg}}
	resp, err := cl.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	_, _ = b.ReadFrom(resp.Body)
	return resp.StatusCode, b.String()
}

func condition(n *corev1.Node, typ corev1.NodeConditionType) *corev1.NodeCondition {
	for i := range n.Status.Conditions {
		if n.Status.Conditions[i].Type == typ {
			return &n.Status.Conditions[i]
		}
	}
	return nil
}

// waitNode polls the node until ok returns true or timeout; it fails the
// test with the last node state otherwise.
func waitNode(t *testing.T, c *cluster.Cluster, name string, timeout time.Duration, what string, ok func(*corev1.Node) bool) *corev1.Node {
	t.Helper()
	var last *corev1.Node
	var lastErr error
	err := wait.PollUntilContextTimeout(context.Background(), 500*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		n, err := c.Client().CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			lastErr = err
			return false, nil
		}
		last = n
		return ok(n), nil
	})
	if err != nil {
		var conds []string
		if last != nil {
			for _, c := range last.Status.Conditions {
				conds = append(conds, fmt.Sprintf("%s=%s(%s: %s)", c.Type, c.Status, c.Reason, c.Message))
			}
		}
		t.Fatalf("node %s: waiting for %s: %v (last error %v; conditions %v)", name, what, err, lastErr, conds)
	}
	return last
}

func readyIs(status corev1.ConditionStatus) func(*corev1.Node) bool {
	return func(n *corev1.Node) bool {
		c := condition(n, corev1.NodeReady)
		return c != nil && c.Status == status
	}
}

// readyAndSettled is Ready=True with the node-lifecycle controller's
// not-ready/unreachable taints gone: it removes them a moment after Ready
// turns True, so a check of the node's taints must wait for this.
func readyAndSettled(n *corev1.Node) bool {
	if !readyIs(corev1.ConditionTrue)(n) {
		return false
	}
	for _, t := range n.Spec.Taints {
		if t.Key == corev1.TaintNodeNotReady || t.Key == corev1.TaintNodeUnreachable {
			return false
		}
	}
	return true
}

// restConfigFor loads a kubeconfig file.
func restConfigFor(t *testing.T, kubeconfig string) *rest.Config {
	t.Helper()
	rc, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	return rc
}

// exitCode extracts the exit code of a finished command error.
func exitCode(err error) int {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	if err == nil {
		return 0
	}
	return -1
}
