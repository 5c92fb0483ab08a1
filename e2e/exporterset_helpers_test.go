package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/wait"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/e2e/jsfake"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// exsEnv is what the ExporterSet scenarios and BenchmarkLease share: a real
// control plane, a registry holding the test OS images, one qemu-kubelet
// node running VMs under TCG, the ExporterSet CRD and the real
// exporterset-controller binary.
type exsEnv struct {
	c        *cluster.Cluster
	cl       client.Client
	node     string
	stateDir string // the node's state dir: every VM's QEMU runs under it
	agentLog string // the node agent's log (-v 2: start timelines included)
	ctrlLog  string // the exporterset-controller's log (-v 2)
	image    string // the test OS image (ACPI variant) in the registry
	panic    string // the variant that prints the boot marker and panics
	reg      string
	ns       string
	recipe   string // the claim recipe of docs/exporterset.md
	metrics  string // the controller's /metrics URL
	js       *jsEnv // the Jumpstarter side, started on first use (jumpstarter_exs_test.go)
}

// startExsEnv starts everything for tb and stops it when tb ends: sets and
// pods are deleted first so their VMs stop, then the controller, the node
// and the control plane; a QEMU left running fails tb.
//
// It takes testing.TB (the benchmark needs it), so it starts the node with
// its own small starter rather than newNodeAgent, which takes *testing.T.
func startExsEnv(tb testing.TB) *exsEnv {
	tb.Helper()
	root := ocitest.RepoRoot(tb)
	tmp := tb.TempDir()
	prebuild(tb, kubeletPkg, ctrlPkg) // under way while the control plane starts
	c := cluster.StartT(tb, cluster.Options{})
	reg := ocitest.StartRegistry(tb, ocitest.RegistryOptions{})
	refs := vmtest.PushTestImages(tb, reg.Addr)
	kubeletBin := goBuild(tb, root, tmp, kubeletPkg)
	ctrlBin := goBuild(tb, root, tmp, ctrlPkg)

	cl := exsClient(tb, c)
	e := &exsEnv{c: c, cl: cl, node: "qk-exs", image: refs[vmtest.VariantACPI], panic: refs[vmtest.VariantPanic], reg: reg.Addr, ns: "default",
		recipe: claimRecipe(tb)}

	ctx := context.Background()
	e.installCRD(tb)

	// Jumpstarter's CRDs before the controller starts: it enables its
	// Jumpstarter mode when the API server serves Exporters and Leases.
	if err := jsfake.InstallCRDs(ctx, c); err != nil {
		tb.Fatal(err)
	}

	e.stateDir = startVMNode(tb, c, kubeletBin, e.node, tmp)
	e.agentLog = filepath.Join(tmp, "qemu-kubelet.log")
	vmtest.ReapQEMU(tb, e.stateDir)
	metricsAddr := fmt.Sprintf("127.0.0.1:%d", testutil.FreePort(tb))
	e.metrics = "http://" + metricsAddr + "/metrics"
	e.ctrlLog = filepath.Join(tmp, "exporterset-controller.log")
	startProcess(tb, "exporterset-controller", e.ctrlLog, ctrlBin,
		"--kubeconfig", c.AdminKubeconfig(),
		"--metrics-bind-address", metricsAddr,
		"--health-probe-bind-address", "127.0.0.1:"+fmt.Sprint(testutil.FreePort(tb)),
		"-v", "2")
	// Runs before the controller, the node and the cluster stop (cleanups
	// are LIFO): sets go, the garbage collector deletes their pods, the
	// node stops their VMs.
	tb.Cleanup(func() { e.deleteAll(tb) })

	e.waitNodeReady(tb, 90*time.Second)
	return e
}

// exsClient is a client of c that knows the core and ExporterSet types.
func exsClient(tb testing.TB, c *cluster.Cluster) client.WithWatch {
	tb.Helper()
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		tb.Fatal(err)
	}
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		tb.Fatal(err)
	}
	cl, err := client.NewWithWatch(c.RESTConfig(), client.Options{Scheme: scheme})
	if err != nil {
		tb.Fatal(err)
	}
	return cl
}

// waitNodeReady waits until the env's node reports Ready.
func (e *exsEnv) waitNodeReady(tb testing.TB, timeout time.Duration) {
	tb.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 500*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		n, err := e.c.Client().CoreV1().Nodes().Get(ctx, e.node, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, cond := range n.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				return cond.Status == corev1.ConditionTrue, nil
			}
		}
		return false, nil
	})
	if err != nil {
		tb.Fatalf("node %s never Ready: %v", e.node, err)
	}
}

// installCRD installs the project's CRDs and waits until ExporterSets are
// served.
func (e *exsEnv) installCRD(tb testing.TB) {
	tb.Helper()
	ctx := context.Background()
	if out, err := e.c.Kubectl(ctx, "apply", "--server-side", "-f", filepath.Join(ocitest.RepoRoot(tb), "config", "crd")); err != nil {
		tb.Fatalf("install CRDs: %v", err)
	} else {
		tb.Logf("%s", strings.TrimSpace(out))
	}
	// Served once established. (kubectl wait --for=condition=Established
	// errors out instead of waiting while the new CRD has no conditions.)
	if err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		return e.cl.List(ctx, &v1alpha1.ExporterSetList{}, client.InNamespace(e.ns)) == nil, nil
	}); err != nil {
		tb.Fatalf("ExporterSet CRD never served: %v", err)
	}
}

// startProcess runs bin in its own process group with output to logPath;
// when tb ends the group is sent SIGTERM (SIGKILL after 15 s) and, if tb
// failed, the log's tail is written to tb's log.
func startProcess(tb testing.TB, name, logPath, bin string, args ...string) {
	tb.Helper()
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		tb.Fatal(err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		tb.Fatalf("start %s: %v", name, err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		logf.Close()
		close(done)
	}()
	tb.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-done
		}
		if tb.Failed() {
			b, _ := os.ReadFile(logPath)
			tb.Logf("%s log (tail):\n%s", name, tail(string(b), 60))
		}
	})
}

// startVMNode writes a node config and starts qemu-kubelet for node name
// (TCG, as the test host has no KVM to rely on); it returns the state dir.
func startVMNode(tb testing.TB, c *cluster.Cluster, bin, name, dir string) string {
	tb.Helper()
	cfgPath, kc, state := writeVMNodeConfig(tb, c, name, dir)
	startProcess(tb, "qemu-kubelet "+name, filepath.Join(dir, "qemu-kubelet.log"), bin,
		"--config", cfgPath, "--kubeconfig", kc, "-v", "2")
	return state
}

// writeVMNodeConfig writes startVMNode's node config under dir; it returns
// the config file, the node's kubeconfig and its state dir.
func writeVMNodeConfig(tb testing.TB, c *cluster.Cluster, name, dir string) (cfgPath, kubeconfig, stateDir string) {
	tb.Helper()
	kc, err := c.NodeKubeconfig(name)
	if err != nil {
		tb.Fatal(err)
	}
	// The node's kubelet API is not used here: loopback is enough.
	ip, port := "127.0.0.1", testutil.FreePort(tb)
	// Not under dir: tb.TempDir() is named after the test, and a long
	// benchmark name makes <state>/vms/<uid>/console.sock longer than a
	// unix socket path may be.
	state, err := os.MkdirTemp("", "qk-node-")
	if err != nil {
		tb.Fatal(err)
	}
	// Registered before the node starts: removed after it stopped.
	tb.Cleanup(func() { _ = os.RemoveAll(state) })
	cfgPath = filepath.Join(dir, "node.yaml")
	cfg := fmt.Sprintf(`apiVersion: qemu-kubelet.io/v1alpha1
kind: NodeConfiguration
nodeName: %s
nodeIP: %s
stateDir: %s
maxVMs: 8
reserved: {cpu: 100m, memory: 256Mi, ephemeral-storage: 1Gi}
accelerator: {policy: tcg, probeTimeout: 20s}
server: {address: %s, port: %d, clientCAFile: %s}
nodeStatusUpdateFrequency: 2s
nodeLeaseDurationSeconds: 12
`, name, ip, state, ip, port, c.CAFile())
	// QK_BENCH_EXS_NODE_CONFIG appends node configuration lines (e.g.
	// "vmNice: 0" for BenchmarkLeaseFromZero).
	cfg += os.Getenv("QK_BENCH_EXS_NODE_CONFIG")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		tb.Fatal(err)
	}
	return cfgPath, kc, state
}

// deleteAll deletes every ExporterSet and pod of the namespace and waits
// until the pods are gone and no QEMU runs on the node.
func (e *exsEnv) deleteAll(tb testing.TB) {
	ctx := context.Background()
	_ = e.cl.DeleteAllOf(ctx, &v1alpha1.ExporterSet{}, client.InNamespace(e.ns))
	_ = e.c.Client().CoreV1().Pods(e.ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		l, err := e.c.Client().CoreV1().Pods(e.ns).List(ctx, metav1.ListOptions{})
		return err == nil && len(l.Items) == 0 && len(vmtest.QEMUPids(e.stateDir)) == 0, nil
	})
	if err != nil {
		tb.Errorf("cleanup: pods or QEMU processes still there after 2m (QEMU pids %v)", vmtest.QEMUPids(e.stateDir))
	}
}

// createSet creates set and, when tb ends, deletes it and waits until the
// garbage collector deleted its pods and their VMs stopped.
func (e *exsEnv) createSet(tb testing.TB, set *v1alpha1.ExporterSet) {
	tb.Helper()
	if err := e.cl.Create(context.Background(), set); err != nil {
		tb.Fatalf("create exporterset %s: %v", set.Name, err)
	}
	tb.Cleanup(func() { e.deleteSet(tb, set.Name) })
}

// deleteSet deletes the set (foreground) and waits until its pods have left
// the API server, their VM dirs are removed and no QEMU runs for them.
func (e *exsEnv) deleteSet(tb testing.TB, name string) {
	tb.Helper()
	ctx := context.Background()
	l, err := e.c.Client().CoreV1().Pods(e.ns).List(ctx, metav1.ListOptions{LabelSelector: "app=" + name})
	if err != nil {
		tb.Fatal(err)
	}
	err = e.cl.Delete(ctx, &v1alpha1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns}},
		client.PropagationPolicy(metav1.DeletePropagationForeground))
	if err != nil && !apierrors.IsNotFound(err) {
		tb.Fatalf("delete exporterset %s: %v", name, err)
	}
	for _, p := range l.Items {
		e.waitVMGone(tb, p, 90*time.Second)
	}
}

// vmTemplate is a VM pod template for the env's node: tolerates the
// provider taint, selects the node, 1 vCPU and 256Mi, a short grace period
// (the ACPI test image powers off at once once booted). Its readiness probe
// asks the guest's HTTP server (port 8080 of the test image), so a Ready pod
// is a booted guest, not just a running QEMU. The probe gives the guest 5 s
// to answer: TCG guests at the node's vmNice on a host busy compiling (CI's
// first run) answered one-second probes late three times in a row, and a
// Ready pod flapping to not Ready changed which pod a scale-in picks (not
// Ready pods go first) and how many Ready pods a node counts.
func (e *exsEnv) vmTemplate(labels map[string]string, image string) corev1.PodTemplateSpec {
	q := resource.MustParse
	return corev1.PodTemplateSpec{
		ObjectMeta: metav1.ObjectMeta{Labels: labels},
		Spec: corev1.PodSpec{
			NodeSelector:                  map[string]string{"kubernetes.io/hostname": e.node},
			Tolerations:                   []corev1.Toleration{{Key: "virtual-kubelet.io/provider", Operator: corev1.TolerationOpEqual, Value: "qemu", Effect: corev1.TaintEffectNoSchedule}},
			TerminationGracePeriodSeconds: ptr.To[int64](10),
			Containers: []corev1.Container{{
				Name: "vm", Image: image,
				Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080, Protocol: corev1.ProtocolTCP}},
				ReadinessProbe: &corev1.Probe{
					ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/", Port: intstr.FromString("http")}},
					PeriodSeconds: 1, TimeoutSeconds: 5, FailureThreshold: 3,
				},
				Resources: corev1.ResourceRequirements{
					Requests: corev1.ResourceList{corev1.ResourceCPU: q("100m"), corev1.ResourceMemory: q("64Mi")},
					Limits:   corev1.ResourceList{corev1.ResourceCPU: q("1"), corev1.ResourceMemory: q("256Mi")},
				},
			}},
		},
	}
}

// newSet returns an ExporterSet named name whose pods carry app=name (the
// label the documented claim recipe selects on).
func (e *exsEnv) newSet(name, image string, replicas, minAvailable int32) *v1alpha1.ExporterSet {
	labels := map[string]string{"app": name}
	return &v1alpha1.ExporterSet{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns},
		Spec: v1alpha1.ExporterSetSpec{
			Replicas:          ptr.To(replicas),
			MinAvailable:      ptr.To(minAvailable),
			Selector:          &metav1.LabelSelector{MatchLabels: labels},
			Template:          e.vmTemplate(labels, image),
			RecyclePolicy:     v1alpha1.RecyclePolicyReplace,
			ScaleDownCooldown: &metav1.Duration{Duration: 3 * time.Second},
		},
	}
}

// counts is what a test expects of a set's status: DESIRED, CURRENT, READY,
// AVAILABLE, LEASED as `kubectl get exs` shows them.
type counts struct{ desired, current, ready, available, leased int32 }

func statusCounts(s *v1alpha1.ExporterSet) counts {
	st := s.Status
	return counts{st.DesiredReplicas, st.Replicas, st.ReadyReplicas, st.AvailableReplicas, st.LeasedReplicas}
}

func (c counts) String() string {
	return fmt.Sprintf("desired=%d current=%d ready=%d available=%d leased=%d", c.desired, c.current, c.ready, c.available, c.leased)
}

// waitSet polls the set until ok (given the set and its live, non-deleted
// pods) or timeout.
func (e *exsEnv) waitSet(tb testing.TB, name string, timeout time.Duration, what string, ok func(*v1alpha1.ExporterSet, []corev1.Pod) bool) (*v1alpha1.ExporterSet, []corev1.Pod) {
	tb.Helper()
	var set v1alpha1.ExporterSet
	var pods []corev1.Pod
	start := time.Now()
	if _, bench := tb.(*testing.B); !bench { // keep benchmark output to its results
		defer func() { tb.Logf("exporterset %s: %s after %s", name, what, time.Since(start).Round(time.Millisecond)) }()
	}
	err := wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		if err := e.cl.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: name}, &set); err != nil {
			return false, nil
		}
		var err error
		if pods, err = e.livePods(ctx, name); err != nil {
			return false, nil
		}
		return ok(&set, pods), nil
	})
	if err != nil {
		var names []string
		for _, p := range pods {
			names = append(names, fmt.Sprintf("%s(%s ready=%v labels=%v)", p.Name, podTag(&p), podReady(&p), p.Labels))
		}
		tb.Fatalf("exporterset %s: waiting for %s: %v; status %s conditions %+v; pods %v", name, what, err,
			statusCounts(&set), set.Status.Conditions, names)
	}
	return &set, pods
}

// waitCounts waits until the set's status shows want and its live pods
// match: current pods, ready pods and leased pods as counted.
func (e *exsEnv) waitCounts(tb testing.TB, name string, want counts, timeout time.Duration) (*v1alpha1.ExporterSet, []corev1.Pod) {
	tb.Helper()
	return e.waitSet(tb, name, timeout, want.String(), func(s *v1alpha1.ExporterSet, pods []corev1.Pod) bool {
		if statusCounts(s) != want || s.Status.ObservedGeneration != s.Generation || int32(len(pods)) != want.current {
			return false
		}
		var ready, leased int32
		for i := range pods {
			if podReady(&pods[i]) {
				ready++
			}
			if _, ok := pods[i].Labels[v1alpha1.LeaseLabel]; ok {
				leased++
			}
		}
		return ready == want.ready && leased == want.leased
	})
}

// livePods are the set's pods (label app=name) not being deleted, oldest
// first.
func (e *exsEnv) livePods(ctx context.Context, name string) ([]corev1.Pod, error) {
	l, err := e.c.Client().CoreV1().Pods(e.ns).List(ctx, metav1.ListOptions{LabelSelector: "app=" + name})
	if err != nil {
		return nil, err
	}
	var out []corev1.Pod
	for _, p := range l.Items {
		if p.DeletionTimestamp == nil {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b corev1.Pod) int { return a.CreationTimestamp.Compare(b.CreationTimestamp.Time) })
	return out, nil
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func podNames(pods []corev1.Pod) []string {
	var out []string
	for _, p := range pods {
		out = append(out, p.Name)
	}
	return out
}

// waitVMGone waits until pod (by UID) has left the API server, its state
// dir is removed and no QEMU runs for it.
func (e *exsEnv) waitVMGone(tb testing.TB, p corev1.Pod, timeout time.Duration) {
	tb.Helper()
	dir := filepath.Join(e.stateDir, "vms", string(p.UID))
	err := wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		got, err := e.c.Client().CoreV1().Pods(e.ns).Get(ctx, p.Name, metav1.GetOptions{})
		if err == nil && got.UID == p.UID {
			return false, nil
		}
		if err != nil && !apierrors.IsNotFound(err) {
			return false, nil
		}
		_, serr := os.Stat(dir)
		return os.IsNotExist(serr) && len(vmtest.QEMUPids(dir)) == 0, nil
	})
	if err != nil {
		tb.Fatalf("pod %s (%s): still in the API server, or its VM dir or QEMU still there after %s (QEMU pids %v)", p.Name, p.UID, timeout, vmtest.QEMUPids(dir))
	}
}

// booted reports whether pod's guest printed the test image's boot marker
// on its serial console.
func (e *exsEnv) booted(p corev1.Pod) bool {
	return consoleShowsBoot(filepath.Join(e.stateDir, "vms", string(p.UID), qemu.ConsoleLogName))
}

// consoleShowsBoot waits up to markerLag for the boot marker in a console
// log. A readiness probe on the guest's HTTP port passes before the guest's
// init prints the marker (it starts httpd, then waits up to 10 s for the
// guest agent's port, then prints it), so Ready does not mean the marker
// is already in the log.
func consoleShowsBoot(path string) bool {
	deadline := time.Now().Add(markerLag)
	for {
		b, _ := os.ReadFile(path)
		if strings.Contains(string(b), vmtest.BootMarker) {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// markerLag bounds the time from a Ready pod to its boot marker (init's
// guest-agent wait of 10 s, on a loaded TCG guest).
const markerLag = 45 * time.Second

// vmRunning reports whether exactly one QEMU runs for pod.
func (e *exsEnv) vmRunning(p corev1.Pod) bool {
	return len(vmtest.QEMUPids(filepath.Join(e.stateDir, "vms", string(p.UID)))) == 1
}

// metricLines returns the controller's metric lines for set (one per
// gauge, as "name value").
func (e *exsEnv) metricLines(tb testing.TB, set string) []string {
	tb.Helper()
	resp, err := http.Get(e.metrics)
	if err != nil {
		tb.Fatalf("GET %s: %v", e.metrics, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		tb.Fatal(err)
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "qemu_kubelet_exporterset_") && strings.Contains(l, `exporterset="`+set+`"`) {
			name, rest, _ := strings.Cut(l, "{")
			_, val, _ := strings.Cut(rest, "} ")
			out = append(out, name+" "+val)
		}
	}
	slices.Sort(out)
	return out
}

// claimRecipe is the shell block under "### Claim" in docs/exporterset.md:
// the tests run the documented recipe itself, with real kubectl and jq.
func claimRecipe(tb testing.TB) string {
	tb.Helper()
	b, err := os.ReadFile(filepath.Join(ocitest.RepoRoot(tb), "docs", "exporterset.md"))
	if err != nil {
		tb.Fatal(err)
	}
	m := regexp.MustCompile("(?s)### Claim.*?```sh\n(.*?)```").FindSubmatch(b)
	if m == nil {
		tb.Fatal("docs/exporterset.md: no ```sh block under ### Claim")
	}
	return string(m[1])
}

var labeledRE = regexp.MustCompile(`pod/(\S+) labeled`)

// claim runs the documented recipe for set as holder me and returns the
// claimed pod's name; it fails tb when kubectl fails.
func (e *exsEnv) claim(tb testing.TB, set, me string) string {
	tb.Helper()
	name, out, err := e.tryClaim(set, me)
	if err != nil {
		tb.Fatalf("claim recipe: %v\n%s", err, out)
	}
	return name
}

func (e *exsEnv) tryClaim(set, me string) (string, string, error) {
	recipe := e.recipe
	// The recipe's first line assigns ns, set and me: override after it.
	recipe = strings.Replace(recipe, "\n", fmt.Sprintf("\nns=%s set=%s me=%s\n", e.ns, set, me), 1)
	cmd := exec.Command("bash", "-euo", "pipefail", "-c", recipe)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+e.c.AdminKubeconfig(), "PATH="+e.c.BinDir()+":"+os.Getenv("PATH"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", string(out), fmt.Errorf("bash recipe: %w", err)
	}
	m := labeledRE.FindStringSubmatch(string(out))
	if m == nil {
		return "", string(out), fmt.Errorf("recipe output names no labeled pod")
	}
	return m[1], string(out), nil
}

// condition returns the set's condition of type typ, or nil.
func setCondition(s *v1alpha1.ExporterSet, typ string) *metav1.Condition {
	return meta.FindStatusCondition(s.Status.Conditions, typ)
}
