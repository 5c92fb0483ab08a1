package cluster

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/qemu-kubelet/qemu-kubelet/internal/pinned"
)

// KubeletClientUser is the identity the apiserver presents to kubelet APIs
// (logs, exec, proxy). It is bound to ClusterRole system:kubelet-api-admin.
const KubeletClientUser = "kube-apiserver-kubelet-client"

// Options tunes a test cluster. The zero value is usable.
type Options struct {
	// BinDir holds etcd, kube-apiserver, kube-scheduler,
	// kube-controller-manager and kubectl. Default: $QK_CONTROL_PLANE_BIN,
	// else the output of hack/build-control-plane.sh (built and cached).
	BinDir string
	// NodeMonitorGracePeriod is how long the node-lifecycle controller waits
	// for a heartbeat before marking a node Unknown. Default 20s.
	NodeMonitorGracePeriod time.Duration
	// KeepDir leaves certificates, kubeconfigs and logs on disk after Stop.
	KeepDir bool
	// Dir is where state goes; default a new temp dir.
	Dir string
	// Logf receives progress lines; default discards.
	Logf func(format string, args ...any)

	// APIServerBindAddress is the address kube-apiserver listens on.
	// Default 127.0.0.1; "0.0.0.0" also serves the addresses of
	// APIServerExtraIPs (clients stay on ServerURL, which is loopback).
	APIServerBindAddress string
	// APIServerExtraIPs are added to the apiserver's serving certificate,
	// for clients that reach it at another address (e.g. from a network
	// namespace).
	APIServerExtraIPs []string
	// Aggregation sets up the aggregation layer: a front-proxy CA and
	// client certificate (--proxy-client-*, --requestheader-*) and
	// --enable-aggregator-routing, so APIServices backed by a selectorless
	// Service plus EndpointSlice (e.g. metrics-server) are served.
	Aggregation bool
	// HPASyncPeriod, if set, is kube-controller-manager's
	// --horizontal-pod-autoscaler-sync-period (default 15s there).
	HPASyncPeriod time.Duration
}

// FrontProxyClientCN is the CN of the apiserver's front-proxy client
// certificate when Options.Aggregation is set (--requestheader-allowed-names).
const FrontProxyClientCN = "front-proxy-client"

// Cluster is a running control plane on loopback.
type Cluster struct {
	opts      Options
	dir       string
	binDir    string
	ca        *ca
	serverURL string
	admin     string
	restCfg   *rest.Config
	client    kubernetes.Interface

	mu    sync.Mutex
	procs []*proc
	stop  sync.Once
}

type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// StartT starts a cluster for a test and stops it when the test ends. On test
// failure the tail of each component log is written to the test log.
func StartT(t testing.TB, opts Options) *Cluster {
	t.Helper()
	if testing.Short() {
		t.Skip("needs a control plane: skipped under -short")
	}
	if opts.Logf == nil {
		opts.Logf = t.Logf
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	c, err := Start(ctx, opts)
	if err != nil {
		t.Fatalf("start test cluster: %v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			c.DumpLogs(t.Logf, 40)
		}
		c.Stop()
	})
	return c
}

// Start builds or finds the binaries and starts etcd, kube-apiserver,
// kube-controller-manager and kube-scheduler, waiting until all are healthy.
// On error everything started so far is stopped.
func Start(ctx context.Context, opts Options) (_ *Cluster, err error) {
	if opts.NodeMonitorGracePeriod == 0 {
		opts.NodeMonitorGracePeriod = 20 * time.Second
	}
	if opts.Logf == nil {
		opts.Logf = func(string, ...any) {}
	}
	binDir, err := ResolveBinDir(ctx, opts.BinDir)
	if err != nil {
		return nil, err
	}
	dir := opts.Dir
	if dir == "" {
		if dir, err = os.MkdirTemp("", "qk-cluster-"); err != nil {
			return nil, err
		}
	} else if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	c := &Cluster{opts: opts, dir: dir, binDir: binDir}
	defer func() {
		if err != nil {
			c.DumpLogs(opts.Logf, 30)
			c.Stop()
		}
	}()
	for _, d := range []string{"pki", "logs", "etcd", "kubeconfig"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o700); err != nil {
			return nil, err
		}
	}
	if err := c.writePKI(); err != nil {
		return nil, fmt.Errorf("generate certificates: %w", err)
	}
	ports, err := freePorts(5)
	if err != nil {
		return nil, err
	}
	etcdPort, etcdPeer, apiPort, kcmPort, schedPort := ports[0], ports[1], ports[2], ports[3], ports[4]
	c.serverURL = fmt.Sprintf("https://127.0.0.1:%d", apiPort)

	kc := func(name, user string, groups ...string) (string, error) {
		p := filepath.Join(dir, "kubeconfig", name+".kubeconfig")
		return p, c.writeKubeconfig(p, user, groups...)
	}
	if c.admin, err = kc("admin", "admin", "system:masters"); err != nil {
		return nil, err
	}
	kcmKC, err := kc("controller-manager", "system:kube-controller-manager")
	if err != nil {
		return nil, err
	}
	schedKC, err := kc("scheduler", "system:kube-scheduler")
	if err != nil {
		return nil, err
	}
	pki := func(f string) string { return filepath.Join(dir, "pki", f) }

	t0 := time.Now()
	etcdURL, err := c.startEtcd(ctx, etcdPort, etcdPeer)
	if err != nil {
		return nil, err
	}
	if err := c.startAPIServer(ctx, etcdURL, apiPort, pki); err != nil {
		return nil, err
	}
	if c.restCfg, err = clientcmd.BuildConfigFromFlags("", c.admin); err != nil {
		return nil, err
	}
	c.restCfg.QPS, c.restCfg.Burst = 100, 200
	if c.client, err = kubernetes.NewForConfig(c.restCfg); err != nil {
		return nil, err
	}
	if err := c.bindKubeletClient(ctx); err != nil {
		return nil, err
	}

	if err := c.startControllers(ctx, kcmKC, schedKC, kcmPort, schedPort, pki); err != nil {
		return nil, err
	}
	// Pods cannot be created before the service account controller has made
	// the namespace's default ServiceAccount.
	if err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := c.client.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		return err == nil, nil
	}); err != nil {
		return nil, fmt.Errorf("default service account never appeared: %w", err)
	}
	opts.Logf("test cluster up in %s at %s (dir %s)", time.Since(t0).Round(time.Millisecond), c.serverURL, dir)
	return c, nil
}

// startEtcd starts etcd on loopback and waits for its health; returns its
// client URL.
func (c *Cluster) startEtcd(ctx context.Context, port, peerPort int) (string, error) {
	dir := c.dir
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", port)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", peerPort)
	if err := c.spawn("etcd",
		"--name=test", "--data-dir="+filepath.Join(dir, "etcd"),
		"--listen-client-urls="+etcdURL, "--advertise-client-urls="+etcdURL,
		"--listen-peer-urls="+peerURL, "--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster=test="+peerURL, "--unsafe-no-fsync", "--log-level=warn",
		"--listen-metrics-urls=", "--quota-backend-bytes=2147483648",
	); err != nil {
		return "", err
	}
	if err := c.waitHTTP(ctx, "etcd", etcdURL+"/health", nil); err != nil {
		return "", err
	}
	return etcdURL, nil
}

// startAPIServer starts kube-apiserver on etcdURL and waits for /readyz.
func (c *Cluster) startAPIServer(ctx context.Context, etcdURL string, apiPort int, pki func(string) string) error {
	bind := c.opts.APIServerBindAddress
	if bind == "" {
		bind = "127.0.0.1"
	}
	apiArgs := []string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=" + bind, "--advertise-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(apiPort),
		"--endpoint-reconciler-type=none",
		"--tls-cert-file=" + pki("apiserver.crt"), "--tls-private-key-file=" + pki("apiserver.key"),
		"--client-ca-file=" + pki("ca.crt"),
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file=" + pki("sa.pub"),
		"--service-account-signing-key-file=" + pki("sa.key"),
		"--service-cluster-ip-range=10.96.0.0/24",
		"--authorization-mode=Node,RBAC",
		"--enable-admission-plugins=NodeRestriction",
		"--kubelet-client-certificate=" + pki("kubelet-client.crt"),
		"--kubelet-client-key=" + pki("kubelet-client.key"),
		"--kubelet-preferred-address-types=InternalIP,Hostname",
		"--allow-privileged=true",
		"--profiling=false",
		"--v=1",
	}
	if c.opts.Aggregation {
		apiArgs = append(apiArgs,
			"--requestheader-client-ca-file="+pki("front-proxy-ca.crt"),
			"--requestheader-allowed-names="+FrontProxyClientCN,
			"--requestheader-extra-headers-prefix=X-Remote-Extra-",
			"--requestheader-group-headers=X-Remote-Group",
			"--requestheader-username-headers=X-Remote-User",
			"--proxy-client-cert-file="+pki("front-proxy-client.crt"),
			"--proxy-client-key-file="+pki("front-proxy-client.key"),
			"--enable-aggregator-routing=true",
		)
	}
	if err := c.spawn("kube-apiserver", apiArgs...); err != nil {
		return err
	}
	if err := c.waitHTTP(ctx, "kube-apiserver", c.serverURL+"/readyz", c.adminTLS()); err != nil {
		return err
	}
	return nil
}

// startControllers starts kube-controller-manager and kube-scheduler and
// waits for their health.
func (c *Cluster) startControllers(ctx context.Context, kcmKC, schedKC string, kcmPort, schedPort int, pki func(string) string) error {
	var kcmExtra []string
	if c.opts.HPASyncPeriod > 0 {
		kcmExtra = append(kcmExtra, "--horizontal-pod-autoscaler-sync-period="+c.opts.HPASyncPeriod.String())
	}
	if err := c.spawn("kube-controller-manager", append([]string{
		"--kubeconfig=" + kcmKC,
		"--authentication-kubeconfig=" + kcmKC, "--authorization-kubeconfig=" + kcmKC,
		"--bind-address=127.0.0.1", "--secure-port=" + strconv.Itoa(kcmPort),
		"--leader-elect=false",
		"--use-service-account-credentials=true",
		"--service-account-private-key-file=" + pki("sa.key"),
		"--root-ca-file=" + pki("ca.crt"),
		"--cluster-signing-cert-file=" + pki("ca.crt"), "--cluster-signing-key-file=" + pki("ca.key"),
		"--node-monitor-grace-period=" + c.opts.NodeMonitorGracePeriod.String(),
		"--node-monitor-period=2s",
		"--profiling=false",
		"--v=1",
	}, kcmExtra...)...); err != nil {
		return err
	}
	if err := c.spawn("kube-scheduler",
		"--kubeconfig="+schedKC,
		"--authentication-kubeconfig="+schedKC, "--authorization-kubeconfig="+schedKC,
		"--bind-address=127.0.0.1", "--secure-port="+strconv.Itoa(schedPort),
		"--leader-elect=false",
		"--profiling=false",
		"--v=1",
	); err != nil {
		return err
	}
	insecure := &tls.Config{InsecureSkipVerify: true} //nolint:gosec // self-signed component certs, loopback only
	if err := c.waitHTTP(ctx, "kube-controller-manager", fmt.Sprintf("https://127.0.0.1:%d/healthz", kcmPort), insecure); err != nil {
		return err
	}
	if err := c.waitHTTP(ctx, "kube-scheduler", fmt.Sprintf("https://127.0.0.1:%d/healthz", schedPort), insecure); err != nil {
		return err
	}
	return nil
}

// ResolveBinDir returns a directory with the control-plane binaries: dir if
// set, else $QK_CONTROL_PLANE_BIN, else the output of
// hack/build-control-plane.sh (which builds once and caches by version).
func ResolveBinDir(ctx context.Context, dir string) (string, error) {
	if dir == "" {
		dir = os.Getenv("QK_CONTROL_PLANE_BIN")
	}
	if dir == "" {
		root, err := RepoRoot()
		if err != nil {
			return "", err
		}
		cmd := exec.CommandContext(ctx, filepath.Join(root, "hack", "build-control-plane.sh"))
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			return "", fmt.Errorf("hack/build-control-plane.sh: %w: %s", err, lastLines(stderr.String(), 20))
		}
		dir = strings.TrimSpace(string(out))
	}
	for _, b := range []string{"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl"} {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			return "", fmt.Errorf("control-plane binary %s missing in %s: %w", b, dir, err)
		}
	}
	return dir, nil
}

// RepoRoot walks up from the working directory to the directory holding
// this project's go.mod.
func RepoRoot() (string, error) {
	d, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if b, err := os.ReadFile(filepath.Join(d, "go.mod")); err == nil && bytes.Contains(b, []byte("module github.com/qemu-kubelet/qemu-kubelet\n")) {
			return d, nil
		}
		parent := filepath.Dir(d)
		if parent == d {
			return "", errors.New("cannot find the qemu-kubelet repository root (go.mod) above the working directory")
		}
		d = parent
	}
}

// Dir is the cluster's state directory (pki/, kubeconfig/, logs/).
func (c *Cluster) Dir() string { return c.dir }

// ServerURL is the apiserver's https URL.
func (c *Cluster) ServerURL() string { return c.serverURL }

// CAFile is the cluster CA certificate, which also signed every client cert.
func (c *Cluster) CAFile() string { return filepath.Join(c.dir, "pki", "ca.crt") }

// AdminKubeconfig is the path of a system:masters kubeconfig.
func (c *Cluster) AdminKubeconfig() string { return c.admin }

// RESTConfig is a copy of the admin client configuration.
func (c *Cluster) RESTConfig() *rest.Config { return rest.CopyConfig(c.restCfg) }

// Client is an admin clientset.
func (c *Cluster) Client() kubernetes.Interface { return c.client }

// BinDir holds the control-plane binaries this cluster runs.
func (c *Cluster) BinDir() string { return c.binDir }

// KubectlPath is the kubectl built with the control plane.
func (c *Cluster) KubectlPath() string { return filepath.Join(c.binDir, "kubectl") }

// Kubectl runs kubectl with the admin kubeconfig and returns its combined output.
func (c *Cluster) Kubectl(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, c.KubectlPath(), append([]string{"--kubeconfig=" + c.admin}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// NodeKubeconfig writes a kubeconfig for a kubelet identity
// (CN=system:node:<name>, O=system:nodes), as the Node authorizer expects.
func (c *Cluster) NodeKubeconfig(nodeName string) (string, error) {
	return c.UserKubeconfig("system:node:"+nodeName, "system:nodes")
}

// UserKubeconfig writes a client-certificate kubeconfig for user and groups.
func (c *Cluster) UserKubeconfig(user string, groups ...string) (string, error) {
	safe := strings.NewReplacer(":", "_", "/", "_").Replace(user)
	p := filepath.Join(c.dir, "kubeconfig", safe+".kubeconfig")
	return p, c.writeKubeconfig(p, user, groups...)
}

// Stop terminates all components (SIGTERM, then SIGKILL after 5s) and
// removes the state directory unless KeepDir is set. Safe to call twice.
func (c *Cluster) Stop() {
	c.stop.Do(func() {
		c.mu.Lock()
		procs := append([]*proc(nil), c.procs...)
		c.mu.Unlock()
		for i := len(procs) - 1; i >= 0; i-- {
			p := procs[i]
			_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
			select {
			case <-p.done:
			case <-time.After(5 * time.Second):
				_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
				<-p.done
			}
		}
		if !c.opts.KeepDir {
			_ = os.RemoveAll(c.dir)
		}
	})
}

// DumpLogs writes the last n lines of each component log through logf.
func (c *Cluster) DumpLogs(logf func(string, ...any), n int) {
	for _, name := range []string{"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"} {
		b, err := os.ReadFile(filepath.Join(c.dir, "logs", name+".log"))
		if err != nil {
			continue
		}
		logf("---- last %d lines of %s ----\n%s", n, name, lastLines(string(b), n))
	}
}

func (c *Cluster) spawn(name string, args ...string) error {
	logf, err := os.Create(filepath.Join(c.dir, "logs", name+".log"))
	if err != nil {
		return err
	}
	cmd := exec.Command(filepath.Join(c.binDir, name), args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// Own process group so Stop reaches any children; Pdeathsig kills the
	// component if the test process dies (panic, timeout, SIGKILL).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := pinned.Start(cmd); err != nil {
		logf.Close()
		return fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		logf.Close()
		close(p.done)
	}()
	c.mu.Lock()
	c.procs = append(c.procs, p)
	c.mu.Unlock()
	return nil
}

// Pids returns the process id of each component started (etcd,
// kube-apiserver, ...), e.g. to read their CPU time.
func (c *Cluster) Pids() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[string]int{}
	for _, p := range c.procs {
		if p.cmd.Process != nil {
			out[p.name] = p.cmd.Process.Pid
		}
	}
	return out
}

func (c *Cluster) proc(name string) *proc {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, p := range c.procs {
		if p.name == name {
			return p
		}
	}
	return nil
}

func (c *Cluster) waitHTTP(ctx context.Context, name, url string, tlsCfg *tls.Config) error {
	hc := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: tlsCfg}}
	defer hc.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	var last string
	for {
		if p := c.proc(name); p != nil {
			select {
			case <-p.done:
				return fmt.Errorf("%s exited during start (%v): %s", name, p.err, lastLines(c.readLog(name), 15))
			default:
			}
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := hc.Do(req)
		if err == nil {
			body := make([]byte, 512)
			n, _ := resp.Body.Read(body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = fmt.Sprintf("HTTP %d: %s", resp.StatusCode, body[:n])
		} else {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s not healthy at %s: %s: %w", name, url, last, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (c *Cluster) readLog(name string) string {
	b, _ := os.ReadFile(filepath.Join(c.dir, "logs", name+".log"))
	return string(b)
}

func (c *Cluster) adminTLS() *tls.Config {
	pool := x509.NewCertPool()
	pool.AddCert(c.ca.cert)
	cert, err := tls.LoadX509KeyPair(filepath.Join(c.dir, "pki", "admin.crt"), filepath.Join(c.dir, "pki", "admin.key"))
	if err != nil {
		return &tls.Config{RootCAs: pool}
	}
	return &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}}
}

func (c *Cluster) writePKI() error {
	var err error
	if c.ca, err = newCA(); err != nil {
		return err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(c.ca.key)
	if err != nil {
		return err
	}
	pki := filepath.Join(c.dir, "pki")
	if err := os.WriteFile(filepath.Join(pki, "ca.crt"), c.ca.certPEM, 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(pki, "ca.key"), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		return err
	}
	leaves := []struct {
		file, cn string
		groups   []string
		server   bool
	}{
		{"apiserver", "kube-apiserver", nil, true},
		{"admin", "admin", []string{"system:masters"}, false},
		{"kubelet-client", KubeletClientUser, nil, false},
	}
	for _, l := range leaves {
		var hosts []string
		if l.server {
			hosts = []string{"127.0.0.1", "::1", "localhost", "10.96.0.1", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"}
			hosts = append(hosts, c.opts.APIServerExtraIPs...)
		}
		crt, key, err := c.ca.issue(l.cn, l.groups, hosts, l.server)
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(pki, l.file+".crt"), crt, 0o644); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(pki, l.file+".key"), key, 0o600); err != nil {
			return err
		}
	}
	if c.opts.Aggregation {
		if err := writeFrontProxyPKI(pki); err != nil {
			return fmt.Errorf("front-proxy certificates: %w", err)
		}
	}
	return writeKeyPair(filepath.Join(pki, "sa.key"), filepath.Join(pki, "sa.pub"))
}

// writeFrontProxyPKI writes a separate front-proxy CA and the client
// certificate the apiserver presents to aggregated APIs, as kubeadm does.
func writeFrontProxyPKI(pki string) error {
	fp, err := newCA()
	if err != nil {
		return err
	}
	crt, key, err := fp.issue(FrontProxyClientCN, nil, nil, false)
	if err != nil {
		return err
	}
	for name, b := range map[string][]byte{"front-proxy-ca.crt": fp.certPEM, "front-proxy-client.crt": crt} {
		if err := os.WriteFile(filepath.Join(pki, name), b, 0o644); err != nil {
			return err
		}
	}
	return os.WriteFile(filepath.Join(pki, "front-proxy-client.key"), key, 0o600)
}

func (c *Cluster) writeKubeconfig(path, user string, groups ...string) error {
	crt, key, err := c.ca.issue(user, groups, nil, false)
	if err != nil {
		return err
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["test"] = &clientcmdapi.Cluster{Server: c.serverURL, CertificateAuthorityData: c.ca.certPEM}
	cfg.AuthInfos[user] = &clientcmdapi.AuthInfo{ClientCertificateData: crt, ClientKeyData: key}
	cfg.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: user}
	cfg.CurrentContext = "test"
	return clientcmd.WriteToFile(*cfg, path)
}

func (c *Cluster) bindKubeletClient(ctx context.Context) error {
	crb := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "kube-apiserver-kubelet-client"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "system:kubelet-api-admin"},
		Subjects:   []rbacv1.Subject{{APIGroup: "rbac.authorization.k8s.io", Kind: "User", Name: KubeletClientUser}},
	}
	// The RBAC bootstrap roles appear shortly after /readyz; retry.
	return wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := c.client.RbacV1().ClusterRoleBindings().Create(ctx, crb, metav1.CreateOptions{})
		if err == nil || apierrors.IsAlreadyExists(err) {
			return true, nil
		}
		return false, nil
	})
}

func freePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	var ports []int
	for i := 0; i < n; i++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("pick a free loopback port: %w", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
