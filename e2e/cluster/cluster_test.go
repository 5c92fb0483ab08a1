package cluster

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// TestClusterLifecycle starts a real control plane, uses it as admin and as
// an unprivileged user, and checks that Stop leaves no component running.
func TestClusterLifecycle(t *testing.T) {
	if testing.Short() {
		t.Skip("needs a control plane: skipped under -short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	c, err := Start(ctx, Options{Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	stopped := false
	defer func() {
		if !stopped {
			c.DumpLogs(t.Logf, 30)
			c.Stop()
		}
	}()

	// kubectl built from source must talk to the apiserver (it refuses an
	// unstamped v0.0.0 server).
	out, err := c.Kubectl(ctx, "version", "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, `"gitVersion": "v1.35.4"`) {
		t.Fatalf("server/client version not stamped v1.35.4:\n%s", out)
	}

	// The controller-manager is really running: it creates the default
	// ServiceAccount in a new namespace.
	ns, err := c.Client().CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "cluster-test-"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := pollUntil(ctx, func() bool {
		_, err := c.Client().CoreV1().ServiceAccounts(ns.Name).Get(ctx, "default", metav1.GetOptions{})
		return err == nil
	}); err != nil {
		t.Fatalf("kube-controller-manager did not create the default ServiceAccount: %v", err)
	}

	// An authenticated user without RBAC is forbidden.
	kc, err := c.UserKubeconfig("nobody")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kc)
	if err != nil {
		t.Fatal(err)
	}
	nobody := kubernetes.NewForConfigOrDie(cfg)
	if _, err := nobody.CoreV1().Pods("default").List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("user without RBAC listing pods: want Forbidden, got %v", err)
	}

	// By default the apiserver listens on loopback only.
	if ip := nonLoopbackIPv4(); ip != "" {
		if conn, err := net.DialTimeout("tcp", net.JoinHostPort(ip, serverPort(t, c)), 2*time.Second); err == nil {
			conn.Close()
			t.Errorf("apiserver reachable at %s by default; want loopback only", ip)
		}
	}

	var pids []int
	for _, p := range c.procs {
		pids = append(pids, p.cmd.Process.Pid)
	}
	if len(pids) != 4 {
		t.Fatalf("want 4 component processes, got %d", len(pids))
	}
	dir := c.Dir()
	c.Stop()
	stopped = true
	for _, pid := range pids {
		if err := syscall.Kill(pid, 0); err == nil {
			t.Errorf("process %d still alive after Stop", pid)
		}
	}
	if _, err := os.Stat(dir); err == nil {
		t.Errorf("state dir %s left behind", dir)
	}
}

func pollUntil(ctx context.Context, f func() bool) error {
	for !f() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	return nil
}

// TestClusterAggregationOptions starts a control plane with the opt-in
// aggregation layer, a wildcard bind address with an extra serving IP and a
// short HPA sync period, and checks each reached the components.
func TestClusterAggregationOptions(t *testing.T) {
	ip := nonLoopbackIPv4()
	if ip == "" {
		t.Fatal("no non-loopback IPv4 address on this host to serve the apiserver on")
	}
	c := StartT(t, Options{Aggregation: true, APIServerBindAddress: "0.0.0.0", APIServerExtraIPs: []string{ip}, HPASyncPeriod: 5 * time.Second})
	ctx := context.Background()

	// The apiserver publishes the front-proxy settings aggregated APIs
	// (metrics-server) read to authenticate proxied requests.
	cm, err := c.Client().CoreV1().ConfigMaps("kube-system").Get(ctx, "extension-apiserver-authentication", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got := cm.Data["requestheader-allowed-names"]; !strings.Contains(got, FrontProxyClientCN) {
		t.Errorf("requestheader-allowed-names = %q, want %s", got, FrontProxyClientCN)
	}
	fpCA, err := os.ReadFile(c.Dir() + "/pki/front-proxy-ca.crt")
	if err != nil {
		t.Fatal(err)
	}
	if got := cm.Data["requestheader-client-ca-file"]; strings.TrimSpace(got) != strings.TrimSpace(string(fpCA)) {
		t.Errorf("requestheader-client-ca-file is not the front-proxy CA:\n%s", got)
	}
	if got := cm.Data["requestheader-username-headers"]; !strings.Contains(got, "X-Remote-User") {
		t.Errorf("requestheader-username-headers = %q", got)
	}

	// Reachable and verifiable (the extra IP is in its certificate) at the
	// non-loopback address.
	pool := x509.NewCertPool()
	caPEM, err := os.ReadFile(c.CAFile())
	if err != nil {
		t.Fatal(err)
	}
	pool.AppendCertsFromPEM(caPEM)
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	resp, err := hc.Get("https://" + net.JoinHostPort(ip, serverPort(t, c)) + "/livez")
	if err != nil {
		t.Fatalf("apiserver at %s: %v", ip, err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("GET /livez at %s: %s", ip, resp.Status)
	}

	// kube-controller-manager got the HPA sync period.
	kcm := c.proc("kube-controller-manager")
	cmdline, err := os.ReadFile("/proc/" + strconv.Itoa(kcm.cmd.Process.Pid) + "/cmdline")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(cmdline), "--horizontal-pod-autoscaler-sync-period=5s") {
		t.Errorf("kube-controller-manager command line lacks the HPA sync period: %q", cmdline)
	}
}

func serverPort(t *testing.T, c *Cluster) string {
	t.Helper()
	u, err := url.Parse(c.ServerURL())
	if err != nil {
		t.Fatal(err)
	}
	return u.Port()
}

func nonLoopbackIPv4() string {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return ""
	}
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil && !ipn.IP.IsLoopback() && !ipn.IP.IsLinkLocalUnicast() {
			return ipn.IP.String()
		}
	}
	return ""
}
