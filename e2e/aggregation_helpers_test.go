package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
)

// The network namespace metrics-server runs in: the API server proxies to
// aggregated APIs only at non-loopback endpoint addresses, so the test
// gives metrics-server its own veth link. Only these two addresses are
// used; traffic stays on this machine.
const (
	aggHostIP = "10.213.0.1" // host side of the veth pair
	aggNSIP   = "10.213.0.2" // inside the namespace
	aggPrefix = "/30"
	// metricsServerPort is metrics-server's secure port inside the namespace.
	metricsServerPort = 4443
)

// netns is a network namespace joined to the host by a veth pair.
type netns struct {
	name   string // ip netns name
	hostIf string // host end of the veth pair
}

// newNetns creates a network namespace with a unique name, a veth pair
// (aggHostIP on the host, aggNSIP inside, default route to the host) and
// removes both when t ends, even on failure.
func newNetns(t *testing.T) *netns {
	t.Helper()
	requireAddrFree(t, aggHostIP, "the metrics-server netns")
	id := randomID(t)
	n := &netns{name: "qk-agg-" + id, hostIf: "qkh" + id}
	peer := "qkn" + id
	ip := ipCmd(t)
	ip("netns", "add", n.name)
	t.Cleanup(func() {
		// Deleting the host end removes the pair; deleting the namespace
		// removes whatever is left in it.
		_ = exec.Command("ip", "link", "del", n.hostIf).Run()
		if out, err := exec.Command("ip", "netns", "del", n.name).CombinedOutput(); err != nil {
			t.Errorf("cleanup: ip netns del %s: %v: %s", n.name, err, out)
		}
	})
	ip("link", "add", n.hostIf, "type", "veth", "peer", "name", peer)
	ip("link", "set", peer, "netns", n.name)
	ip("addr", "add", aggHostIP+aggPrefix, "dev", n.hostIf)
	ip("link", "set", n.hostIf, "up")
	ip("-n", n.name, "addr", "add", aggNSIP+aggPrefix, "dev", peer)
	ip("-n", n.name, "link", "set", peer, "up")
	ip("-n", n.name, "link", "set", "lo", "up")
	ip("-n", n.name, "route", "add", "default", "via", aggHostIP)
	return n
}

// requireAddrFree fails t if addr is already assigned on this host: the
// test reserves it for what.
func requireAddrFree(t *testing.T, addr, what string) {
	t.Helper()
	if addrs, err := net.InterfaceAddrs(); err == nil {
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok && ipn.IP.String() == addr {
				t.Fatalf("%s is already assigned on this host (the same test running elsewhere?); it is reserved for %s", addr, what)
			}
		}
	}
}

// randomID is 6 hex digits, for interface and namespace names (interface
// names are at most 15 characters).
func randomID(t *testing.T) string {
	t.Helper()
	b := make([]byte, 3)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// ipCmd returns a runner of ip(8) that fails t with ip's output.
func ipCmd(t *testing.T) func(args ...string) {
	return func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
}

// kubeconfigVia writes a copy of the cluster's admin kubeconfig that
// reaches the API server at host (same port), for clients in the netns.
func kubeconfigVia(t *testing.T, c *cluster.Cluster, host string) string {
	t.Helper()
	return rewriteServer(t, c.AdminKubeconfig(), host)
}

// startMetricsServer builds metrics-server (hack/build-metrics-server.sh),
// runs it inside ns listening on aggNSIP, and registers it as the
// aggregated API v1beta1.metrics.k8s.io: a selectorless Service in
// kube-system, an EndpointSlice at aggNSIP and the APIService. It returns
// metrics-server's log path.
func startMetricsServer(t *testing.T, c *cluster.Cluster, ns *netns, logDir string) string {
	t.Helper()
	root, err := cluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	b, err := exec.Command(filepath.Join(root, "hack", "build-metrics-server.sh")).Output()
	if err != nil {
		t.Fatalf("hack/build-metrics-server.sh: %v", err)
	}
	kc := kubeconfigVia(t, c, aggHostIP)
	logPath := filepath.Join(logDir, "metrics-server.log")
	startProcess(t, "metrics-server", logPath, "ip", "netns", "exec", ns.name, strings.TrimSpace(string(b)),
		"--kubeconfig="+kc, "--authentication-kubeconfig="+kc, "--authorization-kubeconfig="+kc,
		"--bind-address="+aggNSIP, fmt.Sprintf("--secure-port=%d", metricsServerPort), "--cert-dir="+t.TempDir(),
		"--kubelet-insecure-tls", "--kubelet-preferred-address-types=InternalIP", "--kubelet-use-node-status-port",
		"--metric-resolution=10s", "--kubelet-request-timeout=5s")

	ctx := context.Background()
	cs := c.Client()
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "metrics-server", Namespace: "kube-system"},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{
			Name: "https", Port: 443, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(metricsServerPort),
		}}},
	}
	if _, err := cs.CoreV1().Services("kube-system").Create(ctx, svc, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create metrics-server Service: %v", err)
	}
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "metrics-server", Namespace: "kube-system",
			Labels: map[string]string{discoveryv1.LabelServiceName: "metrics-server", discoveryv1.LabelManagedBy: "qemu-kubelet-e2e"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{aggNSIP}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}}},
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("https"), Port: ptr.To[int32](metricsServerPort), Protocol: ptr.To(corev1.ProtocolTCP)}},
	}
	if _, err := cs.DiscoveryV1().EndpointSlices("kube-system").Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create metrics-server EndpointSlice: %v", err)
	}
	apiSvc := `apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata:
  name: v1beta1.metrics.k8s.io
spec:
  group: metrics.k8s.io
  version: v1beta1
  service: {name: metrics-server, namespace: kube-system, port: 443}
  insecureSkipTLSVerify: true
  groupPriorityMinimum: 100
  versionPriority: 100
`
	p := filepath.Join(t.TempDir(), "apiservice.yaml")
	if err := os.WriteFile(p, []byte(apiSvc), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := c.Kubectl(ctx, "apply", "-f", p); err != nil {
		t.Fatalf("register APIService: %v: %s", err, out)
	}
	// The APIService is Available once the API server reached
	// metrics-server through the veth link.
	if out, err := c.Kubectl(ctx, "wait", "--for=condition=Available", "--timeout=120s", "apiservice/v1beta1.metrics.k8s.io"); err != nil {
		st, _ := c.Kubectl(ctx, "get", "apiservice", "v1beta1.metrics.k8s.io", "-o", "jsonpath={.status}")
		t.Fatalf("APIService v1beta1.metrics.k8s.io never Available: %v: %s\nstatus: %s\nmetrics-server log:\n%s", err, out, st, readTail(logPath, 30))
	}
	return logPath
}

// waitFor polls f every interval until it returns true or timeout.
func waitFor(timeout, interval time.Duration, f func() bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		if f() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(interval)
	}
}

// readTail is the last n lines of the file at path ("" if unreadable).
func readTail(path string, n int) string {
	b, _ := os.ReadFile(path)
	return tail(string(b), n)
}
