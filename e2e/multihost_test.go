package e2e

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// The hosts of TestMultiHost: a bridge on the test machine holding
// mhBridgeIP, and one network namespace per node joined to it by a veth
// pair, with the address mhNet+(10+i). Traffic stays on this machine.
const (
	mhBridgeIP    = "10.214.0.1"
	mhNet         = "10.214.0."
	mhPrefix      = "/24"
	mhKubeletPort = 10250 // every host has its own address: the same port on each
	mhNodes       = 3
)

// mhHost is one simulated host: a network namespace with its own address,
// running one qemu-kubelet with its own state dir.
type mhHost struct {
	name   string // node name
	ns     string // network namespace
	hostIf string // host end of the veth pair, a port of the bridge
	ip     string // the namespace's address, the node's InternalIP
	state  string // the node's state dir
	agent  *nodeAgent
}

// multiHost is TestMultiHost's shared cluster: the exsEnv helpers (set
// status, claims) plus the hosts.
type multiHost struct {
	*exsEnv
	hosts []*mhHost
}

// TestMultiHost runs three qemu-kubelet nodes, each in its own network
// namespace (its own address, its kubelet API on it, its own state dir),
// against one real control plane reachable from the namespaces at the
// bridge's address, with the real exporterset-controller and real QEMU.
// The subtests share the cluster and one ExporterSet and run in order:
// spread over the nodes, drain of one node, loss and return of another.
func TestMultiHost(t *testing.T) {
	requireNetns(t)
	m := startMultiHost(t)
	set := m.spreadSet("spread", 6)
	require.NoError(t, m.cl.Create(context.Background(), set))

	steps := []struct {
		name string
		f    func(*testing.T, string)
	}{
		{"SpreadTwoPerNode", m.testSpread},
		{"DrainPowersOffAndReplacesLeasedWaits", m.testDrain},
		{"NodeLostEvictedReplacedCleanedOnReturn", m.testNodeLost},
	}
	for _, s := range steps {
		// Each step starts from where the previous one left the cluster.
		if !t.Run(s.name, func(t *testing.T) { s.f(t, set.Name) }) {
			t.Fatalf("%s failed: the later steps depend on it", s.name)
		}
	}
}

// requireNetns skips the test where network namespaces cannot be created
// (not root, no CAP_NET_ADMIN/CAP_SYS_ADMIN); CI runs as root.
func requireNetns(t *testing.T) {
	t.Helper()
	testutil.SkipIfShort(t, "network namespaces, a control plane and QEMU")
	if _, err := exec.LookPath("ip"); err != nil {
		t.Fatalf("ip (iproute2) not found: run hack/install-deps.sh: %v", err)
	}
	if os.Geteuid() != 0 {
		t.Skipf("creates network namespaces, a bridge and veth pairs: needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN); running as uid %d", os.Geteuid())
	}
	probe := fmt.Sprintf("qk-probe-%d", os.Getpid())
	if out, err := exec.Command("ip", "netns", "add", probe).CombinedOutput(); err != nil {
		t.Skipf("cannot create a network namespace here (ip netns add: %v: %s)", err, bytes.TrimSpace(out))
	}
	if out, err := exec.Command("ip", "netns", "del", probe).CombinedOutput(); err != nil {
		t.Fatalf("ip netns del %s: %v: %s", probe, err, out)
	}
}

// newHostNet creates the bridge and n namespaces, each with a veth pair
// (default route via the bridge), and removes them all when t ends.
func newHostNet(t *testing.T, n int) []*mhHost {
	t.Helper()
	requireAddrFree(t, mhBridgeIP, "the multi-host bridge")
	id := randomID(t)
	ip := ipCmd(t)
	bridge := "qkbr" + id
	ip("link", "add", bridge, "type", "bridge")
	t.Cleanup(func() {
		if out, err := exec.Command("ip", "link", "del", bridge).CombinedOutput(); err != nil {
			t.Errorf("cleanup: ip link del %s: %v: %s", bridge, err, out)
		}
	})
	ip("addr", "add", mhBridgeIP+mhPrefix, "dev", bridge)
	ip("link", "set", bridge, "up")
	var hosts []*mhHost
	for i := 1; i <= n; i++ {
		h := &mhHost{name: fmt.Sprintf("qk-host-%d", i), ns: fmt.Sprintf("qk-mh-%s-%d", id, i),
			hostIf: fmt.Sprintf("qkh%s%d", id, i), ip: fmt.Sprintf("%s%d", mhNet, 10+i)}
		peer := fmt.Sprintf("qkn%s%d", id, i)
		ip("netns", "add", h.ns)
		t.Cleanup(func() {
			_ = exec.Command("ip", "link", "del", h.hostIf).Run()
			if out, err := exec.Command("ip", "netns", "del", h.ns).CombinedOutput(); err != nil {
				t.Errorf("cleanup: ip netns del %s: %v: %s", h.ns, err, out)
			}
		})
		ip("link", "add", h.hostIf, "type", "veth", "peer", "name", peer)
		ip("link", "set", peer, "netns", h.ns)
		ip("link", "set", h.hostIf, "master", bridge)
		ip("link", "set", h.hostIf, "up")
		ip("-n", h.ns, "addr", "add", h.ip+mhPrefix, "dev", peer)
		ip("-n", h.ns, "link", "set", peer, "up")
		ip("-n", h.ns, "link", "set", "lo", "up")
		ip("-n", h.ns, "route", "add", "default", "via", mhBridgeIP)
		hosts = append(hosts, h)
	}
	return hosts
}

// startMultiHost starts the hosts' network, the control plane (API server
// on every address, its certificate naming the bridge's), a registry on the
// bridge's address, the CRDs, one qemu-kubelet per host inside its
// namespace and the exporterset-controller.
func startMultiHost(t *testing.T) *multiHost {
	t.Helper()
	hosts := newHostNet(t, mhNodes) // first: removed last, after everything using it
	root := ocitest.RepoRoot(t)
	tmp := t.TempDir()
	prebuild(t, kubeletPkg, ctrlPkg) // under way while the control plane starts
	c := cluster.StartT(t, cluster.Options{
		APIServerBindAddress: "0.0.0.0", // reachable at mhBridgeIP from the namespaces
		APIServerExtraIPs:    []string{mhBridgeIP},
	})
	// The nodes pull from it through the bridge (plain HTTP, configured).
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{Host: mhBridgeIP})
	refs := vmtest.PushTestImages(t, reg.Addr)
	kubeletBin := goBuild(t, root, tmp, kubeletPkg)
	ctrlBin := goBuild(t, root, tmp, ctrlPkg)

	scheme := runtime.NewScheme()
	require.NoError(t, clientgoscheme.AddToScheme(scheme))
	require.NoError(t, v1alpha1.AddToScheme(scheme))
	cl, err := client.New(c.RESTConfig(), client.Options{Scheme: scheme})
	require.NoError(t, err)
	ctx := context.Background()
	out, err := c.Kubectl(ctx, "apply", "--server-side", "-f", filepath.Join(root, "config", "crd"))
	require.NoError(t, err, out)
	require.NoError(t, wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		return cl.List(ctx, &v1alpha1.ExporterSetList{}, client.InNamespace("default")) == nil, nil
	}), "ExporterSet CRD never served")

	m := &multiHost{exsEnv: &exsEnv{c: c, cl: cl, image: refs[vmtest.VariantACPI], reg: reg.Addr, ns: "default"}, hosts: hosts}
	for _, h := range hosts {
		m.startHost(t, c, kubeletBin, h)
	}
	for _, h := range hosts {
		n := waitNode(t, c, h.name, 2*time.Minute, "Ready=True without lifecycle taints", readyAndSettled)
		require.Contains(t, n.Status.Addresses, corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: h.ip})
		require.Equal(t, int32(mhKubeletPort), n.Status.DaemonEndpoints.KubeletEndpoint.Port)
	}
	startProcess(t, "exporterset-controller", filepath.Join(tmp, "exporterset-controller.log"), ctrlBin,
		"--kubeconfig", c.AdminKubeconfig(),
		"--metrics-bind-address", fmt.Sprintf("127.0.0.1:%d", testutil.FreePort(t)),
		"--health-probe-bind-address", fmt.Sprintf("127.0.0.1:%d", testutil.FreePort(t)),
		"-v", "2")
	// Runs before the controller, the agents and the cluster stop
	// (cleanups are LIFO).
	t.Cleanup(func() { m.deleteAll(t) })
	return m
}

// startHost writes h's node config (its address, the kubelet API on it,
// its own state dir, the registry on the bridge) and starts its agent in
// h's namespace. The agent is killed (SIGKILL) when t ends; its VMs are
// stopped by deleteAll before, and any left are reaped and fail t.
func (m *multiHost) startHost(t *testing.T, c *cluster.Cluster, bin string, h *mhHost) {
	t.Helper()
	dir := testutil.Searchable(t, t.TempDir()) // QEMU runs as vmUser 107
	kc, err := c.NodeKubeconfig(h.name)
	require.NoError(t, err)
	h.state = filepath.Join(dir, "state")
	a := &nodeAgent{t: t, bin: bin, name: h.name, port: mhKubeletPort, ip: h.ip, dir: dir,
		kubeconfig: rewriteServer(t, kc, mhBridgeIP), configPath: filepath.Join(dir, "node.yaml"),
		logPath: filepath.Join(dir, "qemu-kubelet.log"), netns: h.ns}
	cfg := fmt.Sprintf(`apiVersion: qemu-kubelet.io/v1alpha1
kind: NodeConfiguration
nodeName: %s
nodeIP: %s
stateDir: %s
maxVMs: 6
reserved: {cpu: 100m, memory: 256Mi, ephemeral-storage: 1Gi}
accelerator: {policy: tcg, probeTimeout: 20s}
server: {address: %s, port: %d, clientCAFile: %s}
nodeStatusUpdateFrequency: 2s
nodeLeaseDurationSeconds: 12
images:
  registries:
    %q: {plainHTTP: true}
`, h.name, h.ip, h.state, h.ip, mhKubeletPort, c.CAFile(), m.reg)
	require.NoError(t, os.WriteFile(a.configPath, []byte(cfg), 0o600))
	vmtest.ReapQEMU(t, h.state) // registered first: runs after the agent is killed
	t.Cleanup(func() {
		_ = a.kill(syscall.SIGKILL)
		if t.Failed() {
			t.Logf("qemu-kubelet %s log (tail):\n%s", h.name, readTail(a.logPath, 60))
		}
	})
	h.agent = a
	a.start()
}

// rewriteServer writes a copy of kubeconfig that reaches the API server at
// host (same port), for clients in a network namespace.
func rewriteServer(t *testing.T, kubeconfig, host string) string {
	t.Helper()
	cfg, err := clientcmd.LoadFromFile(kubeconfig)
	require.NoError(t, err)
	for _, cl := range cfg.Clusters {
		u, err := url.Parse(cl.Server)
		require.NoError(t, err)
		cl.Server = "https://" + net.JoinHostPort(host, u.Port())
	}
	p := filepath.Join(t.TempDir(), filepath.Base(kubeconfig))
	require.NoError(t, clientcmd.WriteToFile(*cfg, p))
	return p
}

// spreadSet is an ExporterSet of n VM pods spread over the nodes as
// docs/exporterset.md says: one per hostname at most maxSkew 1 apart,
// cordoned and unreachable nodes not counted (nodeTaintsPolicy Honor), and
// a short stay on a lost node (tolerationSeconds 10).
func (m *multiHost) spreadSet(name string, n int32) *v1alpha1.ExporterSet {
	labels := map[string]string{"app": name}
	tmpl := m.vmTemplate(labels, m.image)
	tmpl.Spec.NodeSelector = map[string]string{"type": "virtual-kubelet"}
	tmpl.Spec.Tolerations = append(tmpl.Spec.Tolerations,
		corev1.Toleration{Key: corev1.TaintNodeUnreachable, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute, TolerationSeconds: ptr.To[int64](10)},
		corev1.Toleration{Key: corev1.TaintNodeNotReady, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute, TolerationSeconds: ptr.To[int64](10)})
	tmpl.Spec.TopologySpreadConstraints = []corev1.TopologySpreadConstraint{{
		MaxSkew: 1, TopologyKey: corev1.LabelHostname, WhenUnsatisfiable: corev1.DoNotSchedule,
		NodeTaintsPolicy: ptr.To(corev1.NodeInclusionPolicyHonor),
		LabelSelector:    &metav1.LabelSelector{MatchLabels: labels},
	}}
	return &v1alpha1.ExporterSet{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: m.ns},
		Spec: v1alpha1.ExporterSetSpec{
			Replicas:          ptr.To(n),
			MinAvailable:      ptr.To[int32](0),
			Selector:          &metav1.LabelSelector{MatchLabels: labels},
			Template:          tmpl,
			RecyclePolicy:     v1alpha1.RecyclePolicyReplace,
			ScaleDownCooldown: &metav1.Duration{Duration: 3 * time.Second},
		},
	}
}

// getWide runs `kubectl get pods -o wide` for selector and returns its
// output and rows (column -> value, read by wideRow).
func (m *multiHost) getWide(t *testing.T, selector string) (string, []map[string]string) {
	t.Helper()
	out, err := m.c.Kubectl(context.Background(), "get", "pods", "-o", "wide", "-l", selector)
	require.NoError(t, err, out)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	var rows []map[string]string
	for _, l := range lines[1:] {
		if f := strings.Fields(l); len(f) > 0 {
			rows = append(rows, wideRow(t, out, f[0]))
		}
	}
	return out, rows
}

// placement is the Running, 1/1 Ready pods of set per node, as
// `kubectl get pods -o wide` shows them, with that output.
func (m *multiHost) placement(t *testing.T, set string) (map[string]int, string, []map[string]string) {
	t.Helper()
	out, rows := m.getWide(t, "app="+set)
	got := map[string]int{}
	for _, r := range rows {
		if r["STATUS"] == "Running" && r["READY"] == "1/1" {
			got[r["NODE"]]++
		}
	}
	return got, out, rows
}

// waitPlacement waits up to timeout until set's Running, 1/1 Ready pods per
// node are want (`kubectl get pods -o wide`, polled each second), then
// checks each such pod's IP is its node's address. The set's status can say
// every pod is ready while one pod's readiness probe (1 s timeout) is
// failing on a host loaded by other work: the spread is what is asserted,
// so a Ready flap is waited out, and the wait fails naming what it saw.
func (m *multiHost) waitPlacement(t *testing.T, set string, want map[string]int, timeout time.Duration, what string) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		got, out, rows := m.placement(t, set)
		if reflect.DeepEqual(got, want) {
			t.Logf("kubectl get pods -o wide -l app=%s:\n%s", set, out)
			for _, r := range rows {
				if r["STATUS"] != "Running" || r["READY"] != "1/1" {
					continue
				}
				if h := m.host(r["NODE"]); assert.NotNil(t, h, "pod %s on unknown node %q", r["NAME"], r["NODE"]) {
					assert.Equal(t, h.ip, r["IP"], "pod %s: IP column is its node's address", r["NAME"])
				}
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: Running 1/1 pods of set %s per node are %v after waiting %s for %v; kubectl get pods -o wide:\n%s", what, set, got, timeout, want, out)
		}
		time.Sleep(time.Second)
	}
}

func (m *multiHost) host(name string) *mhHost {
	for _, h := range m.hosts {
		if h.name == name {
			return h
		}
	}
	return nil
}

// vmDir is where pod p's VM lives on host h.
func (h *mhHost) vmDir(uid types.UID) string { return filepath.Join(h.state, "vms", string(uid)) }

// qemuPids are the QEMU processes of pod uid on h.
func (h *mhHost) qemuPids(uid types.UID) []int { return vmtest.QEMUPids(h.vmDir(uid)) }

// stoppedLine is the agent's log line for stopping pod uid's VM ("" if none).
func (h *mhHost) stoppedLine(uid types.UID) string {
	b, _ := os.ReadFile(h.agent.logPath)
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, `"VM stopped"`) && strings.Contains(l, string(uid)) {
			return l
		}
	}
	return ""
}

// assertACPIPowerOff checks the agent stopped pod uid's VM by the guest's
// own power-off (the ACPI button's doing: the test image's acpid powers
// off), exit code 0, not by quit or kill after the grace.
func (h *mhHost) assertACPIPowerOff(t *testing.T, name string, uid types.UID) {
	t.Helper()
	l := h.stoppedLine(uid)
	if assert.NotEmpty(t, l, "pod %s: no \"VM stopped\" line in %s's log", name, h.name) {
		assert.Contains(t, l, `exitCode=0`, "pod %s: %s", name, l)
		assert.Contains(t, l, `reason="guest powered off"`, "pod %s: powered off by the guest within the grace: %s", name, l)
	}
}

// waitPodGone waits until pod (by UID) has left the API server, its VM dir
// on h is removed and no QEMU runs for it.
func (m *multiHost) waitPodGone(t *testing.T, h *mhHost, p corev1.Pod, timeout time.Duration) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		got, err := m.c.Client().CoreV1().Pods(m.ns).Get(ctx, p.Name, metav1.GetOptions{})
		if err == nil && got.UID == p.UID || err != nil && !apierrors.IsNotFound(err) {
			return false, nil
		}
		_, serr := os.Stat(h.vmDir(p.UID))
		return os.IsNotExist(serr) && len(h.qemuPids(p.UID)) == 0, nil
	})
	if err != nil {
		t.Fatalf("pod %s (%s) on %s: still in the API server, or its VM dir or QEMU still there after %s (QEMU pids %v)", p.Name, p.UID, h.name, timeout, h.qemuPids(p.UID))
	}
}

// podsOn are set's live pods bound to node.
func podsOn(pods []corev1.Pod, node string) []corev1.Pod {
	var out []corev1.Pod
	for _, p := range pods {
		if p.Spec.NodeName == node {
			out = append(out, p)
		}
	}
	return out
}

// kubectlCmd is the real kubectl with the admin kubeconfig.
func (m *multiHost) kubectlCmd(args ...string) *exec.Cmd {
	cmd := exec.Command(m.c.KubectlPath(), args...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+m.c.AdminKubeconfig())
	return cmd
}

// evictDryRun asks the eviction API to evict pod as a server-side dry run.
func (m *multiHost) evictDryRun(ctx context.Context, pod string) error {
	return m.c.Client().PolicyV1().Evictions(m.ns).Evict(ctx, &policyv1.Eviction{
		ObjectMeta:    metav1.ObjectMeta{Name: pod, Namespace: m.ns},
		DeleteOptions: &metav1.DeleteOptions{DryRun: []string{metav1.DryRunAll}},
	})
}

// testSpread: 6 pods, 2 per node, each a booted VM on its own node.
func (m *multiHost) testSpread(t *testing.T, set string) {
	_, pods := m.waitCounts(t, set, counts{6, 6, 6, 6, 0}, 2*vmBoot)
	want := map[string]int{}
	for _, h := range m.hosts {
		want[h.name] = 2
	}
	m.waitPlacement(t, set, want, time.Minute, "topologySpreadConstraints maxSkew 1 over 3 nodes")
	for _, p := range pods {
		h := m.host(p.Spec.NodeName)
		require.NotNil(t, h, "pod %s on %q", p.Name, p.Spec.NodeName)
		assert.Len(t, h.qemuPids(p.UID), 1, "pod %s: one QEMU under %s's state dir", p.Name, h.name)
		assert.True(t, consoleShowsBoot(filepath.Join(h.vmDir(p.UID), qemu.ConsoleLogName)), "pod %s booted", p.Name)
		for _, o := range m.hosts {
			if o != h {
				_, err := os.Stat(o.vmDir(p.UID))
				assert.True(t, os.IsNotExist(err), "pod %s: no VM dir on %s", p.Name, o.name)
			}
		}
	}
}

// pdbRecipe is the PodDisruptionBudget under "**Leased pods and drain.**"
// in docs/exporterset.md, for set: the test applies the documented one.
func pdbRecipe(t *testing.T, set string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(ocitest.RepoRoot(t), "docs", "exporterset.md"))
	require.NoError(t, err)
	mt := regexp.MustCompile("(?s)\\*\\*Leased pods and drain\\.\\*\\*.*?```yaml\n(.*?)```").FindSubmatch(b)
	require.NotNil(t, mt, "docs/exporterset.md: no ```yaml block after **Leased pods and drain.**")
	y := strings.ReplaceAll(string(mt[1]), "rpi4", set)
	require.Contains(t, y, "kind: PodDisruptionBudget")
	return y
}

// testDrain: a pod on the first node is leased and protected by the
// documented PodDisruptionBudget; `kubectl drain` evicts the other pod,
// whose VM powers off by ACPI, and the set replaces it on the other nodes;
// drain waits on the leased pod until its release, then completes; the
// set ends 3 + 3 on the two other nodes.
func (m *multiHost) testDrain(t *testing.T, set string) {
	ctx := context.Background()
	h := m.hosts[0]
	_, pods := m.waitCounts(t, set, counts{6, 6, 6, 6, 0}, vmBoot)
	on := podsOn(pods, h.name)
	require.Len(t, on, 2, "spread left 2 pods on %s", h.name)
	leased, other := on[0], on[1]

	out, err := m.c.Kubectl(ctx, "label", "pod", leased.Name, v1alpha1.LeaseLabel+"=drain-job", v1alpha1.UsedLabel+"=true")
	require.NoError(t, err, out)
	m.waitCounts(t, set, counts{6, 6, 6, 5, 1}, time.Minute)

	// Nothing in Kubernetes knows the lease label: without a budget the
	// eviction API (what drain calls) allows the leased pod's eviction
	// (asked as a server-side dry run: nothing is evicted).
	require.NoError(t, m.evictDryRun(ctx, leased.Name), "eviction of a leased pod without a budget")

	pdbPath := filepath.Join(t.TempDir(), "pdb.yaml")
	require.NoError(t, os.WriteFile(pdbPath, []byte(pdbRecipe(t, set)), 0o600))
	out, err = m.c.Kubectl(ctx, "apply", "-f", pdbPath)
	require.NoError(t, err, out)
	// The disruption controller computes the budget (through the set's
	// scale subresource): 0 disruptions allowed, the leased pod healthy.
	// Its REST mapper refreshes every 30 s: within that time of the CRD's
	// install it fails the sync (SyncFailed, 0 disruptions allowed: still
	// safe) and tries again only on a change of a pod it covers, so touch
	// the leased pod now and then until it is computed.
	var pdbStatus string
	nudges := 0
	require.NoError(t, wait.PollUntilContextTimeout(ctx, time.Second, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		pdb, err := m.c.Client().PolicyV1().PodDisruptionBudgets(m.ns).Get(ctx, set+"-leased", metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		pdbStatus = fmt.Sprintf("%+v", pdb.Status)
		if pdb.Status.ObservedGeneration == pdb.Generation && pdb.Status.CurrentHealthy == 1 && pdb.Status.ExpectedPods > 0 {
			return true, nil
		}
		if nudges++; nudges%10 == 0 {
			_, _ = m.c.Kubectl(ctx, "annotate", "--overwrite", "pod", leased.Name, fmt.Sprintf("e2e.qemu-kubelet.io/nudge=%d", nudges))
		}
		return false, nil
	}), "PodDisruptionBudget %s-leased never computed with the leased pod healthy: %s", set, pdbStatus)
	pdb, err := m.c.Client().PolicyV1().PodDisruptionBudgets(m.ns).Get(ctx, set+"-leased", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, int32(0), pdb.Status.DisruptionsAllowed, "%+v", pdb.Status)
	t.Logf("PodDisruptionBudget %s-leased: %+v (after %d polls)", set, pdb.Status, nudges)
	err = m.evictDryRun(ctx, leased.Name)
	require.True(t, apierrors.IsTooManyRequests(err), "eviction of the leased pod with the budget: want 429 TooManyRequests, got %v", err)
	require.NoError(t, m.evictDryRun(ctx, other.Name), "the budget covers leased pods only")

	// The drain a user runs: no --force, no --delete-emptydir-data.
	drainLog := filepath.Join(t.TempDir(), "drain.log")
	lf, err := os.Create(drainLog)
	require.NoError(t, err)
	drain := m.kubectlCmd("drain", h.name, "--ignore-daemonsets", "--timeout=5m")
	drain.Stdout, drain.Stderr = lf, lf
	require.NoError(t, drain.Start())
	// drained is closed when drain exits, with its error in drainErr.
	drained := make(chan struct{})
	var drainErr error
	go func() { drainErr = drain.Wait(); lf.Close(); close(drained) }()
	t.Cleanup(func() {
		_ = drain.Process.Kill()
		<-drained
		if t.Failed() {
			t.Logf("kubectl drain output:\n%s", readTail(drainLog, 40))
		}
	})

	// The unleased pod is evicted: its VM powers off by ACPI, its state
	// goes, and the set replaces it on another node.
	m.waitPodGone(t, h, other, 2*time.Minute)
	h.assertACPIPowerOff(t, other.Name, other.UID)
	_, pods = m.waitCounts(t, set, counts{6, 6, 6, 5, 1}, vmBoot)
	assert.Equal(t, []string{leased.Name}, podNames(podsOn(pods, h.name)), "only the leased pod stays on the drained node")

	// Drain keeps retrying the leased pod: the budget refuses its eviction.
	ok := waitFor(time.Minute, time.Second, func() bool {
		b, _ := os.ReadFile(drainLog)
		return strings.Contains(string(b), "violate the pod's disruption budget")
	})
	require.True(t, ok, "kubectl drain never reported the budget refusing the leased pod:\n%s", readTail(drainLog, 20))
	select {
	case <-drained:
		t.Fatalf("kubectl drain ended (%v) while a leased pod was on the node:\n%s", drainErr, readTail(drainLog, 20))
	default:
	}
	p, err := m.c.Client().CoreV1().Pods(m.ns).Get(ctx, leased.Name, metav1.GetOptions{})
	require.NoError(t, err)
	assert.Nil(t, p.DeletionTimestamp, "the leased pod is not being deleted")
	assert.Len(t, h.qemuPids(leased.UID), 1, "the leased pod's VM still runs")
	n, err := m.c.Client().CoreV1().Nodes().Get(ctx, h.name, metav1.GetOptions{})
	require.NoError(t, err)
	assert.True(t, n.Spec.Unschedulable, "drain cordoned %s", h.name)

	// Release: the pod leaves the budget; it goes (the controller's
	// Replace recycling or drain's next eviction, whichever is first) by
	// ACPI too, and drain completes.
	out, err = m.c.Kubectl(ctx, "label", "pod", leased.Name, v1alpha1.LeaseLabel+"-")
	require.NoError(t, err, out)
	m.waitPodGone(t, h, leased, 2*time.Minute)
	h.assertACPIPowerOff(t, leased.Name, leased.UID)
	select {
	case <-drained:
		require.NoError(t, drainErr, "kubectl drain:\n%s", readTail(drainLog, 20))
	case <-time.After(time.Minute):
		t.Fatalf("kubectl drain still running a minute after the release:\n%s", readTail(drainLog, 20))
	}
	b, _ := os.ReadFile(drainLog)
	assert.Contains(t, string(b), "node/"+h.name+" drained")
	t.Logf("kubectl drain %s --ignore-daemonsets:\n%s", h.name, b)

	m.waitCounts(t, set, counts{6, 6, 6, 6, 0}, vmBoot)
	want := map[string]int{m.hosts[1].name: 3, m.hosts[2].name: 3}
	m.waitPlacement(t, set, want, time.Minute, "the drained node's pods replaced on the others, still spread")

	out, err = m.c.Kubectl(ctx, "uncordon", h.name)
	require.NoError(t, err, out)
	out, err = m.c.Kubectl(ctx, "delete", "pdb", set+"-leased")
	require.NoError(t, err, out)
}

// testNodeLost: the second node's agent is SIGKILLed and its link cut. The
// node goes NotReady; the set's pods there are evicted after their
// 10 s toleration and replaced on the other nodes, while a pod that
// tolerates unreachable nodes stays bound. One evicted pod is then
// force-deleted (gone from the API server). Link and agent back: the agent
// stops the evicted pods' VMs (ACPI) and the gone one's, removes their
// state, and keeps the bound pod's VM (same QEMU process), Ready again.
func (m *multiHost) testNodeLost(t *testing.T, set string) {
	ctx := context.Background()
	h := m.hosts[1]
	_, pods := m.waitCounts(t, set, counts{6, 6, 6, 6, 0}, vmBoot)
	lost := podsOn(pods, h.name)
	require.NotEmpty(t, lost, "pods on %s", h.name)

	// A pod pinned to the node that stays through its loss.
	pinned := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "pinned", Namespace: m.ns, Labels: map[string]string{"app": "pinned"}},
		Spec:       m.vmTemplate(nil, m.image).Spec,
	}
	pinned.Spec.NodeName = h.name
	pinned.Spec.NodeSelector = nil
	pinned.Spec.Tolerations = append(pinned.Spec.Tolerations,
		corev1.Toleration{Key: corev1.TaintNodeUnreachable, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute},
		corev1.Toleration{Key: corev1.TaintNodeNotReady, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute})
	pinned, err := m.c.Client().CoreV1().Pods(m.ns).Create(ctx, pinned, metav1.CreateOptions{})
	require.NoError(t, err)
	require.NoError(t, wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, vmBoot, true, func(ctx context.Context) (bool, error) {
		p, err := m.c.Client().CoreV1().Pods(m.ns).Get(ctx, pinned.Name, metav1.GetOptions{})
		return err == nil && podReady(p), nil
	}), "pinned pod never Ready on %s", h.name)
	pinnedPids := h.qemuPids(pinned.UID)
	require.Len(t, pinnedPids, 1)
	lostPids := map[types.UID][]int{}
	for _, p := range lost {
		lostPids[p.UID] = h.qemuPids(p.UID)
		require.Len(t, lostPids[p.UID], 1, "pod %s: one QEMU", p.Name)
	}

	// The host goes away: agent killed, link cut. Its VMs keep running.
	_ = h.agent.kill(syscall.SIGKILL)
	out, err := exec.Command("ip", "link", "set", h.hostIf, "down").CombinedOutput()
	require.NoError(t, err, "%s", out)
	restored := false
	t.Cleanup(func() {
		if !restored {
			_ = exec.Command("ip", "link", "set", h.hostIf, "up").Run()
		}
	})
	waitNode(t, m.c, h.name, 2*time.Minute, "Ready=Unknown (NotReady)", readyIs(corev1.ConditionUnknown))
	out2, _ := m.c.Kubectl(ctx, "get", "nodes")
	t.Logf("kubectl get nodes:\n%s", out2)
	assert.Regexp(t, regexp.MustCompile(`(?m)^`+h.name+`\s+NotReady\b`), out2)

	// Evicted after the 10 s toleration: Terminating (nobody confirms), so
	// the set replaces them on the other nodes.
	require.NoError(t, wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		for _, p := range lost {
			got, err := m.c.Client().CoreV1().Pods(m.ns).Get(ctx, p.Name, metav1.GetOptions{})
			if err != nil || got.DeletionTimestamp == nil {
				return false, nil
			}
		}
		return true, nil
	}), "the lost node's set pods were never evicted")
	_, pods = m.waitCounts(t, set, counts{6, 6, 6, 6, 0}, vmBoot)
	assert.Empty(t, podsOn(pods, h.name), "no live set pod on the lost node")
	want := map[string]int{m.hosts[0].name: 3, m.hosts[2].name: 3}
	m.waitPlacement(t, set, want, time.Minute, "replaced on the reachable nodes, still spread")
	p, err := m.c.Client().CoreV1().Pods(m.ns).Get(ctx, pinned.Name, metav1.GetOptions{})
	require.NoError(t, err)
	assert.Nil(t, p.DeletionTimestamp, "the pod tolerating unreachable nodes stays bound")
	for _, p := range lost {
		assert.Equal(t, lostPids[p.UID], h.qemuPids(p.UID), "pod %s: its VM still runs on the cut-off host", p.Name)
	}

	// An admin force-deletes one evicted pod: gone from the API server
	// while its VM still runs on the host.
	gone := lost[0]
	out3, err := m.c.Kubectl(ctx, "delete", "pod", gone.Name, "--force", "--grace-period=0")
	require.NoError(t, err, out3)
	_, err = m.c.Client().CoreV1().Pods(m.ns).Get(ctx, gone.Name, metav1.GetOptions{})
	require.True(t, apierrors.IsNotFound(err), "force-deleted pod %s: %v", gone.Name, err)

	// The host comes back.
	out, err = exec.Command("ip", "link", "set", h.hostIf, "up").CombinedOutput()
	require.NoError(t, err, "%s", out)
	restored = true
	h.agent.start()
	waitNode(t, m.c, h.name, 2*time.Minute, "Ready=True without lifecycle taints", readyAndSettled)
	for _, p := range lost {
		m.waitPodGone(t, h, p, 2*time.Minute)
	}
	for _, p := range lost[1:] {
		h.assertACPIPowerOff(t, p.Name, p.UID) // Terminating: stopped by the ACPI button
	}
	assert.Equal(t, pinnedPids, h.qemuPids(pinned.UID), "the bound pod keeps its VM (same QEMU process)")
	require.NoError(t, wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		p, err := m.c.Client().CoreV1().Pods(m.ns).Get(ctx, pinned.Name, metav1.GetOptions{})
		return err == nil && podReady(p) && p.DeletionTimestamp == nil, nil
	}), "the pinned pod is not Ready again on %s", h.name)
	_, pods = m.waitCounts(t, set, counts{6, 6, 6, 6, 0}, time.Minute)
	assert.Empty(t, podsOn(pods, h.name))
	ents, err := os.ReadDir(filepath.Join(h.state, "vms"))
	require.NoError(t, err)
	var dirs []string
	for _, e := range ents {
		dirs = append(dirs, e.Name())
	}
	assert.Equal(t, []string{string(pinned.UID)}, dirs, "only the bound pod's VM dir is left on %s", h.name)
}

// deleteAll deletes the sets and pods and waits until the pods are gone
// and no QEMU runs on any host.
func (m *multiHost) deleteAll(t *testing.T) {
	ctx := context.Background()
	_ = m.cl.DeleteAllOf(ctx, &v1alpha1.ExporterSet{}, client.InNamespace(m.ns))
	_ = m.c.Client().CoreV1().Pods(m.ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
	running := func() []int {
		var pids []int
		for _, h := range m.hosts {
			pids = append(pids, vmtest.QEMUPids(h.state)...)
		}
		slices.Sort(pids)
		return pids
	}
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		l, err := m.c.Client().CoreV1().Pods(m.ns).List(ctx, metav1.ListOptions{})
		return err == nil && len(l.Items) == 0 && len(running()) == 0, nil
	})
	if err != nil {
		t.Errorf("cleanup: pods or QEMU processes still there after 2m (QEMU pids %v)", running())
	}
}
