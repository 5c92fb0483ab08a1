package build

import (
	"context"
	"encoding/base64"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"sigs.k8s.io/yaml"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
)

// buildAgent builds cmd/qemu-kubelet into a temp dir.
func buildAgent(t *testing.T, root string) string {
	t.Helper()
	testutil.SkipIfShort(t, "a go build of cmd/qemu-kubelet")
	out := filepath.Join(t.TempDir(), "qemu-kubelet")
	cmd := exec.Command("go", "build", "-o", out, "./cmd/qemu-kubelet")
	cmd.Dir = root
	b, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build ./cmd/qemu-kubelet: %s", b)
	return out
}

// TestSystemdUnit: docs/systemd/qemu-kubelet.service passes
// `systemd-analyze verify` without a single warning (unknown keys are only
// warnings there), with ExecStart pointing at a real qemu-kubelet build,
// and keeps the settings docs/off-cluster.md relies on.
func TestSystemdUnit(t *testing.T) {
	root := testutil.MustRepoRoot(t)
	unit, err := os.ReadFile(filepath.Join(root, "docs", "systemd", "qemu-kubelet.service"))
	require.NoError(t, err)
	s := string(unit)
	for _, want := range []string{
		"KillMode=process", // VMs outlive agent restarts
		"ExecStart=/usr/local/bin/qemu-kubelet --config=/etc/qemu-kubelet/config.yaml --kubeconfig=/etc/qemu-kubelet/kubeconfig",
		"StateDirectory=qemu-kubelet",
		"ReadWritePaths=/var/lib/qemu-kubelet",
		"DeviceAllow=/dev/kvm rw",
		"Restart=always",
	} {
		assert.Contains(t, s, want)
	}
	assert.NotContains(t, s, "PrivateDevices=yes", "would hide /dev/kvm")
	assert.NotContains(t, s, "MemoryDenyWriteExecute=yes", "would break QEMU's TCG")

	bin := buildAgent(t, root)
	dir := t.TempDir()
	path := filepath.Join(dir, "qemu-kubelet.service")
	require.NoError(t, os.WriteFile(path, []byte(strings.ReplaceAll(s, "/usr/local/bin/qemu-kubelet", bin)), 0o644))
	cmd := exec.Command("systemd-analyze", "verify", "--man=no", path)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "systemd-analyze verify: %s", out)
	assert.Empty(t, strings.TrimSpace(string(out)), "systemd-analyze verify warnings")

	// The check is real: a misspelt key is reported.
	bad := filepath.Join(dir, "bad.service")
	require.NoError(t, os.WriteFile(bad, []byte(strings.Replace(strings.ReplaceAll(s, "/usr/local/bin/qemu-kubelet", bin), "\nKillMode=process", "\nKillMod=process", 1)), 0o644))
	out, _ = exec.Command("systemd-analyze", "verify", "--man=no", bad).CombinedOutput()
	assert.Contains(t, string(out), "KillMod")
}

// TestOffClusterConfigExample: docs/systemd/config.yaml passes the agent's
// strict loader and validation, with the state dir the unit provides.
func TestOffClusterConfigExample(t *testing.T) {
	root := testutil.MustRepoRoot(t)
	file, err := config.Load(filepath.Join(root, "docs", "systemd", "config.yaml"))
	require.NoError(t, err)
	n, err := config.Resolve(file, config.Environment{Hostname: "kvm-01", HostIP: "192.0.2.10"})
	require.NoError(t, err)
	assert.Equal(t, "qemu-kvm-01", n.NodeName)
	assert.Equal(t, "/var/lib/qemu-kubelet", n.StateDir)
	assert.Equal(t, "require-kvm", n.AcceleratorPolicy)
}

// TestClientCertificateJoin runs the client-certificate procedure of
// docs/off-cluster.md against a real API server: key and request with
// openssl, a CertificateSigningRequest for the kube-apiserver-client-kubelet
// signer approved by an admin, the kubeconfig written with kubectl config,
// then the real qemu-kubelet with that kubeconfig and the example config
// (adjusted to this machine) registers a Ready node whose identity the Node
// authorizer restricts. (The bootstrap-token variant is not run: the test
// API server does not enable bootstrap token authentication.)
func TestClientCertificateJoin(t *testing.T) {
	root := testutil.MustRepoRoot(t)
	bin := buildAgent(t, root)
	c := cluster.StartT(t, cluster.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	const node = "qemu-kvm-01"
	dir := testutil.Searchable(t, t.TempDir()) // QEMU runs as vmUser 107: it searches its way to the state dir
	run := func(name string, args ...string) string {
		t.Helper()
		cmd := exec.CommandContext(ctx, name, args...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s %s: %s", name, strings.Join(args, " "), out)
		return string(out)
	}
	kubectl := c.KubectlPath()

	// On the host: key and request.
	run("openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "node.key")
	run("openssl", "req", "-new", "-key", "node.key", "-subj", "/O=system:nodes/CN=system:node:"+node, "-out", "node.csr")
	csrPEM, err := os.ReadFile(filepath.Join(dir, "node.csr"))
	require.NoError(t, err)
	csr := fmt.Sprintf(`apiVersion: certificates.k8s.io/v1
kind: CertificateSigningRequest
metadata:
  name: qemu-kubelet-%s
spec:
  signerName: kubernetes.io/kube-apiserver-client-kubelet
  usages: [digital signature, client auth]
  request: %s
`, node, base64.StdEncoding.EncodeToString(csrPEM))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "csr.yaml"), []byte(csr), 0o600))

	// (a) approved by an administrator.
	_, err = c.Kubectl(ctx, "create", "-f", filepath.Join(dir, "csr.yaml"))
	require.NoError(t, err)
	_, err = c.Kubectl(ctx, "certificate", "approve", "qemu-kubelet-"+node)
	require.NoError(t, err)
	var certB64 string
	require.NoError(t, wait.PollUntilContextTimeout(ctx, time.Second, time.Minute, true, func(ctx context.Context) (bool, error) {
		certB64, err = c.Kubectl(ctx, "get", "csr", "qemu-kubelet-"+node, "-o", "jsonpath={.status.certificate}")
		return err == nil && strings.TrimSpace(certB64) != "", nil
	}), "signed certificate")
	cert, err := base64.StdEncoding.DecodeString(strings.TrimSpace(certB64))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "node.crt"), cert, 0o600))

	// The kubeconfig, as documented.
	kc := filepath.Join(dir, "kubeconfig")
	run(kubectl, "config", "--kubeconfig="+kc, "set-cluster", "k", "--server="+c.ServerURL(), "--certificate-authority="+c.CAFile(), "--embed-certs")
	run(kubectl, "config", "--kubeconfig="+kc, "set-credentials", "node", "--client-certificate=node.crt", "--client-key=node.key", "--embed-certs")
	run(kubectl, "config", "--kubeconfig="+kc, "set-context", "k", "--cluster=k", "--user=node")
	run(kubectl, "config", "--kubeconfig="+kc, "use-context", "k")
	assert.Contains(t, run(kubectl, "--kubeconfig="+kc, "auth", "whoami"), "system:node:"+node)

	// The example config, adjusted to this machine.
	raw, err := os.ReadFile(filepath.Join(root, "docs", "systemd", "config.yaml"))
	require.NoError(t, err)
	var cfg map[string]any
	require.NoError(t, yaml.Unmarshal(raw, &cfg))
	ip := testutil.HostIPv4(t)
	cfg["nodeIP"] = ip
	cfg["stateDir"] = filepath.Join(dir, "state")
	cfg["accelerator"] = map[string]any{"policy": "tcg"} // no usable KVM here
	cfg["reserved"] = map[string]any{"cpu": "100m", "memory": "256Mi", "ephemeral-storage": "1Gi"}
	cfg["server"] = map[string]any{"address": ip, "port": testutil.FreePort(t), "clientCAFile": c.CAFile()}
	require.Equal(t, node, cfg["nodeName"], "the example's nodeName is the certificate's")
	b, err := yaml.Marshal(cfg)
	require.NoError(t, err)
	cfgPath := filepath.Join(dir, "config.yaml")
	require.NoError(t, os.WriteFile(cfgPath, b, 0o600))

	logPath := filepath.Join(dir, "qemu-kubelet.log")
	logf, err := os.Create(logPath)
	require.NoError(t, err)
	agent := exec.Command(bin, "--config="+cfgPath, "--kubeconfig="+kc, "-v=2")
	agent.Stdout, agent.Stderr = logf, logf
	agent.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	require.NoError(t, agent.Start())
	done := make(chan struct{})
	go func() { _ = agent.Wait(); logf.Close(); close(done) }()
	t.Cleanup(func() {
		_ = syscall.Kill(-agent.Process.Pid, syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-agent.Process.Pid, syscall.SIGKILL)
			<-done
		}
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			t.Logf("qemu-kubelet log:\n%s", b)
		}
	})

	require.NoError(t, wait.PollUntilContextTimeout(ctx, time.Second, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		n, err := c.Client().CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, cond := range n.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				return cond.Status == corev1.ConditionTrue, nil
			}
		}
		return false, nil
	}), "node %s Ready", node)
	n, err := c.Client().CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, "r12", n.Labels["example.com/rack"], "labels from the example config")

	// The Node authorizer restricts this identity: no secrets it has no pod
	// for, no other node's objects.
	_, err = c.Kubectl(ctx, "create", "secret", "generic", "unrelated", "-n", "default", "--from-literal=k=v")
	require.NoError(t, err)
	out, err := exec.CommandContext(ctx, kubectl, "--kubeconfig="+kc, "get", "secret", "unrelated", "-n", "default").CombinedOutput()
	require.Error(t, err, "node identity read an unrelated secret: %s", out)
	assert.Contains(t, string(out), "Forbidden")
	out, err = exec.CommandContext(ctx, kubectl, "--kubeconfig="+kc, "label", "node", node, "--overwrite", "node-role.kubernetes.io/control-plane=").CombinedOutput()
	require.Error(t, err, "NodeRestriction let the node set a restricted label: %s", out)
	b, err = os.ReadFile(logPath)
	require.NoError(t, err)
	assert.NotContains(t, strings.ToLower(string(b)), "forbidden", "the agent was refused an API request")
}
