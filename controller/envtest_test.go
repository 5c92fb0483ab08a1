package controller

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zapcore"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
	qktest "github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// env is the real kube-apiserver + etcd shared by the tests of this package.
var env struct {
	cfg        *rest.Config
	scheme     *runtime.Scheme
	client     client.Client
	kubectl    string
	kubeconfig string
}

const waitTimeout = 60 * time.Second

// controlPlaneBin returns KUBEBUILDER_ASSETS, or builds the control plane
// with hack/build-control-plane.sh (cached) and returns its bin dir.
func controlPlaneBin(root string) (string, error) {
	if d := os.Getenv("KUBEBUILDER_ASSETS"); d != "" {
		return d, nil
	}
	cmd := exec.Command(filepath.Join(root, "hack", "build-control-plane.sh"))
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("hack/build-control-plane.sh: %w", err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	return lines[len(lines)-1], nil
}

func TestMain(m *testing.M) {
	flag.Parse()
	if testing.Short() {
		// The TestEnvtest* tests need a control plane (envtest): not under
		// -short (make unit); the unit tests still run.
		fmt.Fprintln(os.Stderr, "controller tests: -short: envtest not started, TestEnvtest* skipped")
		if err := flag.Set("test.skip", "^TestEnvtest"); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(m.Run())
	}
	os.Exit(runTests(m))
}

func runTests(m *testing.M) int {
	// Errors only, unless EXS_TEST_VERBOSE is set.
	lvl := zapcore.ErrorLevel
	if os.Getenv("EXS_TEST_VERBOSE") != "" {
		lvl = zapcore.Level(-2)
	}
	ctrl.SetLogger(zap.New(zap.WriteTo(os.Stderr), zap.Level(lvl)))
	if lvl == zapcore.ErrorLevel {
		// client-go logs through klog directly, e.g. events still queued
		// when a test's manager stops.
		klog.SetLogger(logr.Discard())
	}
	root, err := qktest.RepoRoot()
	if err != nil {
		fmt.Fprintln(os.Stderr, "controller tests:", err)
		return 1
	}
	bin, err := controlPlaneBin(root)
	if err != nil {
		fmt.Fprintln(os.Stderr, "controller tests: control plane:", err)
		return 1
	}
	testEnv := &envtest.Environment{
		BinaryAssetsDirectory: bin,
		// The Jumpstarter CRDs generated from api/jumpstarter/v1alpha1 make
		// the apiserver serve the Exporters and Leases of Jumpstarter mode
		// (e2e/jsfake checks the same objects against upstream's schema).
		CRDDirectoryPaths: []string{filepath.Join(root, "config", "crd"), qktest.JumpstarterCRDs(root),
			qktest.VirtualTargetCRDs(root)},
		ErrorIfCRDPathMissing: true,
	}
	cfg, err := testEnv.Start()
	if err != nil {
		fmt.Fprintln(os.Stderr, "controller tests: start envtest:", err)
		// Start leaves etcd and the API server running when a later step
		// (CRD install) fails.
		_ = testEnv.Stop()
		return 1
	}
	stop := func() {
		if err := testEnv.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "controller tests: stop envtest:", err)
		}
	}
	defer stop()
	defer qktest.GuardCleanup("controller tests", stop)()
	env.cfg = cfg
	env.scheme = runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(env.scheme); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := jsv1.AddToScheme(env.scheme); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := v1alpha1.AddToScheme(env.scheme); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := vtv1.AddToScheme(env.scheme); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	env.client, err = client.New(cfg, client.Options{Scheme: env.scheme})
	if err != nil {
		fmt.Fprintln(os.Stderr, "controller tests: client:", err)
		return 1
	}
	dir, err := os.MkdirTemp("", "exs-envtest-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	env.kubeconfig = filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(env.kubeconfig, testEnv.KubeConfig, 0o600); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	env.kubectl = filepath.Join(bin, "kubectl")
	return m.Run()
}

// kubectl runs the real kubectl against the test apiserver.
func kubectl(t *testing.T, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, env.kubectl, append([]string{"--kubeconfig", env.kubeconfig}, args...)...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

func mustKubectl(t *testing.T, args ...string) string {
	t.Helper()
	out, err := kubectl(t, args...)
	require.NoError(t, err, "kubectl %v: %s", args, out)
	return out
}

// namespace creates a namespace for one test.
func namespace(t *testing.T) string {
	t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "exs-"}}
	require.NoError(t, env.client.Create(context.Background(), ns))
	t.Cleanup(func() { _ = env.client.Delete(context.Background(), ns) })
	return ns.Name
}

// startManager runs the controller for one namespace until the test ends.
func startManager(t *testing.T, ns string) *prometheus.Registry {
	t.Helper()
	reg := prometheus.NewRegistry()
	metrics, err := NewMetrics(reg)
	require.NoError(t, err)
	mgr, err := ctrl.NewManager(env.cfg, ctrl.Options{
		Scheme:                 env.scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Cache:                  cache.Options{DefaultNamespaces: map[string]cache.Config{ns: {}}},
		Controller:             ctrlConfigUnique(),
	})
	require.NoError(t, err)
	r := NewReconciler(mgr.GetClient(), mgr.GetEventRecorder("exporterset-controller"), metrics)
	require.NoError(t, r.SetupWithManager(mgr, 2))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			assert.NoError(t, err, "manager")
		case <-time.After(waitTimeout):
			t.Error("manager did not stop")
		}
	})
	return reg
}

// sampleSet is a set whose pods select on app=<name>.
func sampleSet(ns, name string, replicas int32, mutate ...func(*v1alpha1.ExporterSet)) *v1alpha1.ExporterSet {
	s := &v1alpha1.ExporterSet{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: v1alpha1.ExporterSetSpec{
			Replicas:          ptr.To(replicas),
			Selector:          &metav1.LabelSelector{MatchLabels: map[string]string{"app": name}},
			ScaleDownCooldown: &metav1.Duration{},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": name}},
				Spec: corev1.PodSpec{
					RestartPolicy: corev1.RestartPolicyNever,
					Containers:    []corev1.Container{{Name: "vm", Image: "registry.invalid/os/debian:13"}},
				},
			},
		},
	}
	for _, m := range mutate {
		m(s)
	}
	return s
}

func createSet(t *testing.T, s *v1alpha1.ExporterSet) {
	t.Helper()
	require.NoError(t, env.client.Create(context.Background(), s))
}

// pods lists the live pods of a set (by the app label), straight from the
// apiserver.
func pods(t *testing.T, ns, app string) []corev1.Pod {
	t.Helper()
	var l corev1.PodList
	require.NoError(t, env.client.List(context.Background(), &l, client.InNamespace(ns), client.MatchingLabels{"app": app}))
	var out []corev1.Pod
	for _, p := range l.Items {
		if p.DeletionTimestamp == nil {
			out = append(out, p)
		}
	}
	return out
}

// eventually polls cond until it holds or waitTimeout passes.
func eventually(t *testing.T, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	last := ""
	for time.Now().Before(deadline) {
		ok, state := cond()
		if ok {
			return
		}
		last = state
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("timed out waiting for %s; last state: %s", what, last)
}

func waitPodCount(t *testing.T, ns, app string, n int) []corev1.Pod {
	t.Helper()
	var ps []corev1.Pod
	eventually(t, fmt.Sprintf("%d pods of %s", n, app), func() (bool, string) {
		ps = pods(t, ns, app)
		return len(ps) == n, fmt.Sprintf("%d pods", len(ps))
	})
	return ps
}

// setReady plays the kubelet: marks a pod Running and Ready through the
// status subresource.
func setReady(t *testing.T, p *corev1.Pod) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, env.client.Get(ctx, client.ObjectKeyFromObject(p), p))
	p.Status.Phase = corev1.PodRunning
	p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: metav1.Now()}}
	require.NoError(t, env.client.Status().Update(ctx, p))
}

func readyAll(t *testing.T, ps []corev1.Pod) {
	t.Helper()
	for i := range ps {
		if !isReady(&ps[i]) {
			setReady(t, &ps[i])
		}
	}
}

func getPod(t *testing.T, p *corev1.Pod) *corev1.Pod {
	t.Helper()
	var out corev1.Pod
	require.NoError(t, env.client.Get(context.Background(), client.ObjectKeyFromObject(p), &out))
	return &out
}

func isReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
			return true
		}
	}
	return false
}

func getSet(t *testing.T, ns, name string) *v1alpha1.ExporterSet {
	t.Helper()
	var s v1alpha1.ExporterSet
	require.NoError(t, env.client.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, &s))
	return &s
}

func waitStatus(t *testing.T, ns, name, what string, cond func(st v1alpha1.ExporterSetStatus) bool) *v1alpha1.ExporterSet {
	t.Helper()
	var s *v1alpha1.ExporterSet
	eventually(t, "status of "+name+": "+what, func() (bool, string) {
		s = getSet(t, ns, name)
		b, _ := json.Marshal(s.Status)
		return s.Status.ObservedGeneration == s.Generation && cond(s.Status), string(b)
	})
	return s
}

func condition(st v1alpha1.ExporterSetStatus, typ string) *metav1.Condition {
	for i := range st.Conditions {
		if st.Conditions[i].Type == typ {
			return &st.Conditions[i]
		}
	}
	return nil
}

func uids(ps []corev1.Pod) map[types.UID]string {
	out := map[types.UID]string{}
	for _, p := range ps {
		out[p.UID] = p.Name
	}
	return out
}

// laggingReader reads sets live but shows pods as they were at the last
// sync: a cache that lags behind the apiserver.
type laggingReader struct {
	client.Client
	snapshot *corev1.PodList
}

func (l *laggingReader) sync(t *testing.T, ns string) {
	t.Helper()
	l.snapshot = &corev1.PodList{}
	require.NoError(t, l.Client.List(context.Background(), l.snapshot, client.InNamespace(ns)))
}

func (l *laggingReader) List(ctx context.Context, list client.ObjectList, opts ...client.ListOption) error {
	pl, ok := list.(*corev1.PodList)
	if !ok || l.snapshot == nil {
		return l.Client.List(ctx, list, opts...)
	}
	lo := (&client.ListOptions{}).ApplyOptions(opts)
	pl.Items = nil
	for _, p := range l.snapshot.Items {
		if p.Namespace == lo.Namespace && (lo.LabelSelector == nil || lo.LabelSelector.Matches(labelsOf(p))) {
			pl.Items = append(pl.Items, *p.DeepCopy())
		}
	}
	return nil
}

type labelsOf corev1.Pod

func (p labelsOf) Has(k string) bool   { _, ok := p.Labels[k]; return ok }
func (p labelsOf) Get(k string) string { return p.Labels[k] }
func (p labelsOf) Lookup(k string) (string, bool) {
	v, ok := p.Labels[k]
	return v, ok
}

// recorder counts events instead of sending them (for the standalone
// reconciler; the manager tests use the real event broadcaster).
type countingRecorder struct{ reasons chan string }

func (c countingRecorder) Eventf(_ runtime.Object, _ runtime.Object, _, reason, _, _ string, _ ...interface{}) {
	c.reasons <- reason
}

func reconcileOnce(t *testing.T, r *Reconciler, ns, name string) {
	t.Helper()
	_, err := r.Reconcile(context.Background(), ctrl.Request{NamespacedName: types.NamespacedName{Namespace: ns, Name: name}})
	require.NoError(t, err)
}

func TestEnvtestOnePassAndLaggingCache(t *testing.T) {
	ns := namespace(t)
	createSet(t, sampleSet(ns, "burst", 30))
	lag := &laggingReader{Client: env.client}
	lag.sync(t, ns) // the cache knows no pods yet, and will not learn of them
	rec := countingRecorder{reasons: make(chan string, 1000)}
	r := NewReconciler(env.client, rec, nil)
	r.Reader = lag

	reconcileOnce(t, r, ns, "burst")
	assert.Len(t, pods(t, ns, "burst"), 30, "one reconcile creates every missing pod")
	for range 3 {
		reconcileOnce(t, r, ns, "burst") // the cache still shows none
	}
	assert.Len(t, pods(t, ns, "burst"), 30, "a lagging cache must not double-create")
	// Slow start: batches of 1, 2, 4, 8 and the remaining 15, one event each.
	assert.Len(t, rec.reasons, 5)

	lag.sync(t, ns)
	reconcileOnce(t, r, ns, "burst")
	assert.Len(t, pods(t, ns, "burst"), 30)
	assert.Equal(t, int32(30), getSet(t, ns, "burst").Status.Replicas)

	// Scale down with the cache lagging on deletes: no second round.
	s := getSet(t, ns, "burst")
	s.Spec.Replicas = ptr.To[int32](10)
	require.NoError(t, env.client.Update(context.Background(), s))
	reconcileOnce(t, r, ns, "burst")
	assert.Len(t, pods(t, ns, "burst"), 10)
	reconcileOnce(t, r, ns, "burst") // snapshot still shows all 30 live
	assert.Len(t, pods(t, ns, "burst"), 10, "a lagging cache must not double-delete")
	lag.sync(t, ns)
	reconcileOnce(t, r, ns, "burst")
	assert.Len(t, pods(t, ns, "burst"), 10)
}

func TestEnvtestDeletePreconditionSparesClaimedPod(t *testing.T) {
	ns := namespace(t)
	createSet(t, sampleSet(ns, "race", 2))
	r := NewReconciler(env.client, countingRecorder{reasons: make(chan string, 100)}, nil)
	lag := &laggingReader{Client: env.client}
	r.Reader = lag
	reconcileOnce(t, r, ns, "race")
	ps := pods(t, ns, "race")
	require.Len(t, ps, 2)

	s := getSet(t, ns, "race")
	s.Spec.Replicas = ptr.To[int32](0)
	require.NoError(t, env.client.Update(context.Background(), s))
	lag.sync(t, ns) // the decision is made on this view, where nobody holds a lease
	for _, p := range ps {
		mustKubectl(t, "-n", ns, "label", "pod", p.Name, v1alpha1.LeaseLabel+"=ci-1", v1alpha1.UsedLabel+"=true")
	}
	reconcileOnce(t, r, ns, "race")
	after := pods(t, ns, "race")
	assert.Equal(t, uids(ps), uids(after), "pods claimed after the decision must survive its deletes")
	for _, p := range after {
		assert.Equal(t, "ci-1", p.Labels[v1alpha1.LeaseLabel])
	}
}

func TestEnvtestScaleSubresourceAndColumns(t *testing.T) {
	ns := namespace(t)
	reg := startManager(t, ns)
	createSet(t, sampleSet(ns, "web", 1))
	waitPodCount(t, ns, "web", 1)

	out := mustKubectl(t, "-n", ns, "scale", "exs/web", "--replicas=4")
	assert.Contains(t, out, "scaled")
	assert.Equal(t, int32(4), *getSet(t, ns, "web").Spec.Replicas, "the scale subresource moves spec.replicas")
	ps := waitPodCount(t, ns, "web", 4)
	readyAll(t, ps)
	waitStatus(t, ns, "web", "4 ready", func(st v1alpha1.ExporterSetStatus) bool {
		return st.ReadyReplicas == 4 && st.AvailableReplicas == 4 && st.Replicas == 4
	})

	raw := mustKubectl(t, "get", "--raw", fmt.Sprintf("/apis/qemu-kubelet.io/v1alpha1/namespaces/%s/exportersets/web/scale", ns))
	var scale struct {
		Spec   struct{ Replicas int32 }
		Status struct {
			Replicas int32
			Selector string
		}
	}
	require.NoError(t, json.Unmarshal([]byte(raw), &scale), raw)
	assert.Equal(t, int32(4), scale.Spec.Replicas)
	assert.Equal(t, int32(4), scale.Status.Replicas)
	assert.Equal(t, "app=web", scale.Status.Selector)

	table := mustKubectl(t, "-n", ns, "get", "exs")
	lines := strings.Split(strings.TrimSpace(table), "\n")
	require.Len(t, lines, 2, table)
	assert.Equal(t, []string{"NAME", "DESIRED", "CURRENT", "READY", "AVAILABLE", "LEASED", "PENDING", "AGE"}, strings.Fields(lines[0]))
	assert.Equal(t, []string{"web", "4", "4", "4", "4", "0", "0"}, strings.Fields(lines[1])[:7])

	s := getSet(t, ns, "web")
	assert.Equal(t, metav1.ConditionTrue, condition(s.Status, v1alpha1.ConditionAvailable).Status)
	assert.Equal(t, metav1.ConditionFalse, condition(s.Status, v1alpha1.ConditionProgressing).Status)
	assert.Equal(t, metav1.ConditionFalse, condition(s.Status, v1alpha1.ConditionReplicaFailure).Status)
	assert.Equal(t, int32(4), s.Status.UpdatedReplicas)

	eventually(t, "metrics", func() (bool, string) {
		n, err := testutil.GatherAndCount(reg, "qemu_kubelet_exporterset_ready_replicas")
		return err == nil && n == 1, fmt.Sprint(n, err)
	})
	expected := `
# HELP qemu_kubelet_exporterset_available_replicas Ready, unleased pods of the ExporterSet (the warm buffer).
# TYPE qemu_kubelet_exporterset_available_replicas gauge
qemu_kubelet_exporterset_available_replicas{exporterset="web",namespace="` + ns + `"} 4
# HELP qemu_kubelet_exporterset_desired_replicas Effective target number of pods: max(replicas, leased + pending leases + minAvailable), capped by maxReplicas.
# TYPE qemu_kubelet_exporterset_desired_replicas gauge
qemu_kubelet_exporterset_desired_replicas{exporterset="web",namespace="` + ns + `"} 4
`
	assert.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(expected),
		"qemu_kubelet_exporterset_available_replicas", "qemu_kubelet_exporterset_desired_replicas"))

	eventually(t, "SuccessfulCreate events", func() (bool, string) {
		var evs corev1.EventList
		require.NoError(t, env.client.List(context.Background(), &evs, client.InNamespace(ns)))
		for _, e := range evs.Items {
			if e.Reason == EventSuccessfulCreate && e.InvolvedObject.Name == "web" && strings.HasPrefix(e.Message, "Created pod") {
				return true, e.Message
			}
		}
		return false, fmt.Sprintf("%d events", len(evs.Items))
	})
	describe := mustKubectl(t, "-n", ns, "describe", "exs", "web")
	assert.Contains(t, describe, EventSuccessfulCreate)
	assert.Contains(t, describe, "MinimumReplicasAvailable")
}

func TestEnvtestWarmBufferAndLeasedSurviveScaleDown(t *testing.T) {
	ns := namespace(t)
	startManager(t, ns)
	createSet(t, sampleSet(ns, "pool", 1, func(s *v1alpha1.ExporterSet) { s.Spec.MinAvailable = ptr.To[int32](2) }))
	ps := waitPodCount(t, ns, "pool", 2)
	readyAll(t, ps)
	waitStatus(t, ns, "pool", "2 available", func(st v1alpha1.ExporterSetStatus) bool { return st.AvailableReplicas == 2 })

	// Claim one pod with the documented recipe; a second claim loses.
	claimed := ps[0]
	mustKubectl(t, "-n", ns, "label", "pod", claimed.Name, v1alpha1.LeaseLabel+"=ci-1", v1alpha1.UsedLabel+"=true",
		"--resource-version="+getPod(t, &claimed).ResourceVersion)
	out, err := kubectl(t, "-n", ns, "label", "pod", claimed.Name, v1alpha1.LeaseLabel+"=ci-2", v1alpha1.UsedLabel+"=true")
	assert.Error(t, err, "a second claim without --overwrite must fail")
	assert.Contains(t, out, "already has a value")
	// With --resource-version from a stale read the claim fails on the server.
	out, err = kubectl(t, "-n", ns, "label", "pod", ps[1].Name, v1alpha1.LeaseLabel+"=ci-3", v1alpha1.UsedLabel+"=true",
		"--resource-version="+claimed.ResourceVersion)
	assert.Error(t, err, "a claim on a stale resourceVersion must fail")
	assert.Contains(t, out, "the object has been modified")

	// The warm buffer grows: leased 1 + minAvailable 2 = 3.
	ps = waitPodCount(t, ns, "pool", 3)
	readyAll(t, ps)
	waitStatus(t, ns, "pool", "3 pods, 1 leased, 2 available", func(st v1alpha1.ExporterSetStatus) bool {
		return st.Replicas == 3 && st.LeasedReplicas == 1 && st.AvailableReplicas == 2 && st.DesiredReplicas == 3
	})

	mustKubectl(t, "-n", ns, "scale", "exs/pool", "--replicas=5")
	readyAll(t, waitPodCount(t, ns, "pool", 5))

	// Scale to zero with no buffer: only the leased pod survives.
	mustKubectl(t, "-n", ns, "patch", "exs", "pool", "--type=merge", "-p", `{"spec":{"replicas":0,"minAvailable":0}}`)
	ps = waitPodCount(t, ns, "pool", 1)
	assert.Equal(t, claimed.UID, ps[0].UID, "the leased pod survives scale-down")
	waitStatus(t, ns, "pool", "1 leased", func(st v1alpha1.ExporterSetStatus) bool {
		return st.Replicas == 1 && st.LeasedReplicas == 1 && st.DesiredReplicas == 1
	})
}

func TestEnvtestReplaceRetiresReleasedPod(t *testing.T) {
	ns := namespace(t)
	startManager(t, ns)
	createSet(t, sampleSet(ns, "rp", 2))
	ps := waitPodCount(t, ns, "rp", 2)
	readyAll(t, ps)
	waitStatus(t, ns, "rp", "2 available", func(st v1alpha1.ExporterSetStatus) bool { return st.AvailableReplicas == 2 })

	victim := ps[0]
	// Claim and release back to back: the used mark must retire the pod
	// even if the controller never saw the lease label.
	mustKubectl(t, "-n", ns, "label", "pod", victim.Name, v1alpha1.LeaseLabel+"=ci-1", v1alpha1.UsedLabel+"=true")
	mustKubectl(t, "-n", ns, "label", "pod", victim.Name, v1alpha1.LeaseLabel+"-")
	eventually(t, "released pod deleted and replaced", func() (bool, string) {
		now := pods(t, ns, "rp")
		_, still := uids(now)[victim.UID]
		return !still && len(now) == 2, fmt.Sprintf("%d pods, victim present %v", len(now), still)
	})
}

func TestEnvtestReplaceMarksLeaseWithoutUsedLabel(t *testing.T) {
	ns := namespace(t)
	startManager(t, ns)
	createSet(t, sampleSet(ns, "mark", 1))
	ps := waitPodCount(t, ns, "mark", 1)
	readyAll(t, ps)
	// A client that sets only the lease label still gets a used pod retired.
	mustKubectl(t, "-n", ns, "label", "pod", ps[0].Name, v1alpha1.LeaseLabel+"=ci-1")
	eventually(t, "used mark added by the controller", func() (bool, string) {
		p := getPod(t, &ps[0])
		return p.Labels[v1alpha1.UsedLabel] == "true", fmt.Sprintf("%v", p.Labels)
	})
	mustKubectl(t, "-n", ns, "label", "pod", ps[0].Name, v1alpha1.LeaseLabel+"-")
	eventually(t, "released pod replaced", func() (bool, string) {
		now := pods(t, ns, "mark")
		_, still := uids(now)[ps[0].UID]
		return !still && len(now) == 1, fmt.Sprintf("%d pods, old present %v", len(now), still)
	})
}

func TestEnvtestReuseClearsUsedMark(t *testing.T) {
	ns := namespace(t)
	startManager(t, ns)
	createSet(t, sampleSet(ns, "ru", 1, func(s *v1alpha1.ExporterSet) { s.Spec.RecyclePolicy = v1alpha1.RecyclePolicyReuse }))
	ps := waitPodCount(t, ns, "ru", 1)
	readyAll(t, ps)
	mustKubectl(t, "-n", ns, "label", "pod", ps[0].Name, v1alpha1.LeaseLabel+"=ci-1", v1alpha1.UsedLabel+"=true")
	mustKubectl(t, "-n", ns, "label", "pod", ps[0].Name, v1alpha1.LeaseLabel+"-")
	eventually(t, "used mark cleared", func() (bool, string) {
		now := pods(t, ns, "ru")
		if len(now) != 1 {
			return false, fmt.Sprintf("%d pods", len(now))
		}
		_, used := now[0].Labels[v1alpha1.UsedLabel]
		return now[0].UID == ps[0].UID && !used, fmt.Sprintf("labels %v", now[0].Labels)
	})
	waitStatus(t, ns, "ru", "1 available", func(st v1alpha1.ExporterSetStatus) bool { return st.AvailableReplicas == 1 })
	// Claimable again with the same recipe.
	mustKubectl(t, "-n", ns, "label", "pod", ps[0].Name, v1alpha1.LeaseLabel+"=ci-2", v1alpha1.UsedLabel+"=true")
}

// TestEnvtestLeaseExpiry: a lease with qemu-kubelet.io/lease-expires-at
// ends at that time without any event but the controller's own requeue:
// with Reuse the controller removes the lease label and annotations, then
// the used mark, and the same pod is free again; a malformed expiry is
// reported (Warning event) and the lease holds.
func TestEnvtestLeaseExpiry(t *testing.T) {
	ns := namespace(t)
	startManager(t, ns)
	createSet(t, sampleSet(ns, "ex", 2, func(s *v1alpha1.ExporterSet) { s.Spec.RecyclePolicy = v1alpha1.RecyclePolicyReuse }))
	ps := waitPodCount(t, ns, "ex", 2)
	readyAll(t, ps)
	waitStatus(t, ns, "ex", "2 available", func(st v1alpha1.ExporterSetStatus) bool { return st.AvailableReplicas == 2 })

	expires := time.Now().Add(4 * time.Second).UTC().Format(time.RFC3339)
	mustKubectl(t, "-n", ns, "label", "pod", ps[0].Name, v1alpha1.LeaseLabel+"=ci-1", v1alpha1.UsedLabel+"=true")
	mustKubectl(t, "-n", ns, "annotate", "pod", ps[0].Name, v1alpha1.LeaseExpiresAnnotation+"="+expires)
	mustKubectl(t, "-n", ns, "label", "pod", ps[1].Name, v1alpha1.LeaseLabel+"=ci-2", v1alpha1.UsedLabel+"=true")
	mustKubectl(t, "-n", ns, "annotate", "pod", ps[1].Name, v1alpha1.LeaseExpiresAnnotation+"=tomorrow")
	waitStatus(t, ns, "ex", "2 leased", func(st v1alpha1.ExporterSetStatus) bool { return st.LeasedReplicas == 2 })
	eventually(t, "lease of the first pod expired and its pod free again", func() (bool, string) {
		p := getPod(t, &ps[0])
		_, leased := p.Labels[v1alpha1.LeaseLabel]
		_, used := p.Labels[v1alpha1.UsedLabel]
		_, ann := p.Annotations[v1alpha1.LeaseExpiresAnnotation]
		return !leased && !used && !ann, fmt.Sprintf("labels %v annotations %v", p.Labels, p.Annotations)
	})
	assert.False(t, time.Now().Before(mustParse(t, expires)), "not before the expiry")
	p := getPod(t, &ps[1])
	assert.Equal(t, "ci-2", p.Labels[v1alpha1.LeaseLabel], "a malformed expiry does not end the lease")
	waitStatus(t, ns, "ex", "1 leased, 1 available", func(st v1alpha1.ExporterSetStatus) bool {
		return st.LeasedReplicas == 1 && st.AvailableReplicas == 1 && st.Replicas == 2
	})
	for reason, msg := range map[string]string{EventInvalidLeaseExpiry: `"tomorrow" is not an RFC 3339 time`, EventLeaseExpired: "Lease of pod " + ps[0].Name + " expired"} {
		eventually(t, reason+" event", func() (bool, string) {
			var evs corev1.EventList
			require.NoError(t, env.client.List(context.Background(), &evs, client.InNamespace(ns)))
			for _, e := range evs.Items {
				if e.Reason == reason && strings.Contains(e.Message, msg) {
					return true, e.Message
				}
			}
			return false, fmt.Sprintf("%d events", len(evs.Items))
		})
	}
	assert.Len(t, pods(t, ns, "ex"), 2, "Reuse: nothing deleted")
}

func mustParse(t *testing.T, s string) time.Time {
	t.Helper()
	v, err := time.Parse(time.RFC3339, s)
	require.NoError(t, err)
	return v
}

func TestEnvtestImagePullFailureNoChurn(t *testing.T) {
	ns := namespace(t)
	startManager(t, ns)
	createSet(t, sampleSet(ns, "bad", 2))
	ps := waitPodCount(t, ns, "bad", 2)
	for i := range ps {
		p := &ps[i]
		require.NoError(t, env.client.Get(context.Background(), client.ObjectKeyFromObject(p), p))
		p.Status.Phase = corev1.PodPending
		p.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "vm", Image: "registry.invalid/os/debian:13",
			State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "ImagePullBackOff",
				Message: "Back-off pulling image \"registry.invalid/os/debian:13\""}}}}
		require.NoError(t, env.client.Status().Update(context.Background(), p))
	}
	s := waitStatus(t, ns, "bad", "ReplicaFailure", func(st v1alpha1.ExporterSetStatus) bool {
		c := condition(st, v1alpha1.ConditionReplicaFailure)
		return c != nil && c.Status == metav1.ConditionTrue
	})
	c := condition(s.Status, v1alpha1.ConditionReplicaFailure)
	assert.Equal(t, "ImagePullBackOff", c.Reason)
	assert.Contains(t, c.Message, `Back-off pulling image "registry.invalid/os/debian:13"`)
	assert.Equal(t, uids(ps), uids(pods(t, ns, "bad")), "pods that cannot pull are not churned")
}

func TestEnvtestFailedPodReplaced(t *testing.T) {
	ns := namespace(t)
	startManager(t, ns)
	createSet(t, sampleSet(ns, "crash", 1))
	ps := waitPodCount(t, ns, "crash", 1)
	p := &ps[0]
	require.NoError(t, env.client.Get(context.Background(), client.ObjectKeyFromObject(p), p))
	p.Status.Phase, p.Status.Reason, p.Status.Message = corev1.PodFailed, "QEMUExited", "qemu exited with status 1"
	require.NoError(t, env.client.Status().Update(context.Background(), p))
	eventually(t, "failed pod replaced", func() (bool, string) {
		now := pods(t, ns, "crash")
		return len(now) == 1 && now[0].UID != p.UID, fmt.Sprintf("%d pods", len(now))
	})
	s := waitStatus(t, ns, "crash", "one failure counted", func(st v1alpha1.ExporterSetStatus) bool { return st.ConsecutiveFailures == 1 })
	assert.NotNil(t, s.Status.LastFailureTime)
}

// staleSetReader shows one old version of the set (a cache that has not
// seen the controller's last status write) and everything else live.
type staleSetReader struct {
	client.Client
	set *v1alpha1.ExporterSet
}

func (r staleSetReader) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	if s, ok := obj.(*v1alpha1.ExporterSet); ok && key == client.ObjectKeyFromObject(r.set) {
		r.set.DeepCopyInto(s)
		return nil
	}
	return r.Client.Get(ctx, key, obj, opts...)
}

func TestEnvtestStaleCachedStatusKeepsBackoff(t *testing.T) {
	ns := namespace(t)
	createSet(t, sampleSet(ns, "backoff", 1))
	// The cache's version: two failures, the last an hour ago (its backoff
	// long over).
	s := getSet(t, ns, "backoff")
	s.Status.ConsecutiveFailures = 2
	s.Status.LastFailureTime = ptr.To(metav1.NewTime(time.Now().Add(-time.Hour)))
	require.NoError(t, env.client.Status().Update(context.Background(), s))
	stale := getSet(t, ns, "backoff")
	// The stored version, as the controller's last reconcile wrote it: a
	// third failure just now, so the next create waits 20 s.
	s = stale.DeepCopy()
	s.Status.ConsecutiveFailures = 3
	s.Status.LastFailureTime = ptr.To(metav1.Now())
	require.NoError(t, env.client.Status().Update(context.Background(), s))
	key := client.ObjectKeyFromObject(s)

	cases := []struct {
		name        string
		apiReader   client.Reader
		wantCreated int
	}{
		// Documents the bug the APIReader check fixes.
		{name: "without the check the stale backoff creates at once", apiReader: nil, wantCreated: 1},
		{name: "with the check nothing is created and the plan is made again", apiReader: env.client, wantCreated: 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, p := range pods(t, ns, "backoff") {
				require.NoError(t, env.client.Delete(context.Background(), &p))
			}
			r := NewReconciler(env.client, countingRecorder{reasons: make(chan string, 100)}, nil)
			r.Reader = staleSetReader{Client: env.client, set: stale}
			r.APIReader = tc.apiReader
			r.written.Store(key, s.ResourceVersion) // as if this reconciler had written the stored status
			res, err := r.Reconcile(context.Background(), ctrl.Request{NamespacedName: types.NamespacedName{Namespace: ns, Name: "backoff"}})
			require.NoError(t, err)
			assert.Len(t, pods(t, ns, "backoff"), tc.wantCreated)
			if tc.wantCreated == 0 {
				assert.NotZero(t, res.RequeueAfter, "planned again once the cache caught up")
				// With the stored version the backoff holds.
				r.Reader = env.client
				reconcileOnce(t, r, ns, "backoff")
				assert.Empty(t, pods(t, ns, "backoff"), "the stored backoff (20 s) holds")
			}
		})
	}
}

func TestEnvtestCELValidation(t *testing.T) {
	ns := namespace(t)
	cases := []struct {
		name    string
		mutate  func(*v1alpha1.ExporterSet)
		message string
	}{
		{"minAvailable above maxReplicas", func(s *v1alpha1.ExporterSet) {
			s.Spec.MinAvailable, s.Spec.MaxReplicas = ptr.To[int32](5), ptr.To[int32](3)
		}, "spec.minAvailable must not exceed spec.maxReplicas"},
		{"replicas above maxReplicas", func(s *v1alpha1.ExporterSet) {
			s.Spec.Replicas, s.Spec.MaxReplicas = ptr.To[int32](4), ptr.To[int32](3)
		}, "spec.replicas must not exceed spec.maxReplicas"},
		{"empty selector", func(s *v1alpha1.ExporterSet) {
			s.Spec.Selector = &metav1.LabelSelector{}
		}, "spec.selector must not be empty"},
		{"unknown recycle policy", func(s *v1alpha1.ExporterSet) {
			s.Spec.RecyclePolicy = "Recycle"
		}, `Unsupported value: "Recycle"`},
		{"negative replicas", func(s *v1alpha1.ExporterSet) {
			s.Spec.Replicas = ptr.To[int32](-1)
		}, "should be greater than or equal to 0"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := env.client.Create(context.Background(), sampleSet(ns, "invalid", 1, tc.mutate))
			require.Error(t, err)
			assert.True(t, apierrors.IsInvalid(err), "%v", err)
			assert.Contains(t, err.Error(), tc.message)
		})
	}

	// The same through kubectl, as a user sees it.
	manifest := fmt.Sprintf(`apiVersion: qemu-kubelet.io/v1alpha1
kind: ExporterSet
metadata: {name: bad, namespace: %s}
spec:
  replicas: 2
  minAvailable: 4
  maxReplicas: 3
  selector: {matchLabels: {app: bad}}
  template:
    metadata: {labels: {app: bad}}
    spec: {containers: [{name: vm, image: x}]}
`, ns)
	f := filepath.Join(t.TempDir(), "bad.yaml")
	require.NoError(t, os.WriteFile(f, []byte(manifest), 0o600))
	out, err := kubectl(t, "apply", "-f", f)
	assert.Error(t, err)
	assert.Contains(t, out, "spec.minAvailable must not exceed spec.maxReplicas")

	// Defaults are applied, and the selector is immutable.
	createSet(t, sampleSet(ns, "good", 1, func(s *v1alpha1.ExporterSet) { s.Spec.ScaleDownCooldown = nil }))
	s := getSet(t, ns, "good")
	assert.Equal(t, v1alpha1.RecyclePolicyReplace, s.Spec.RecyclePolicy)
	assert.Equal(t, int32(0), *s.Spec.MinAvailable)
	assert.Equal(t, 30*time.Second, s.Spec.ScaleDownCooldown.Duration)
	s.Spec.Selector = &metav1.LabelSelector{MatchLabels: map[string]string{"app": "good", "x": "y"}}
	s.Spec.Template.Labels["x"] = "y"
	err = env.client.Update(context.Background(), s)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "spec.selector is immutable")

	// kubectl scale beyond maxReplicas is refused with the rule's message.
	createSet(t, sampleSet(ns, "capped", 1, func(s *v1alpha1.ExporterSet) { s.Spec.MaxReplicas = ptr.To[int32](3) }))
	out, err = kubectl(t, "-n", ns, "scale", "exs/capped", "--replicas=9")
	assert.Error(t, err)
	assert.Contains(t, out, "spec.replicas must not exceed spec.maxReplicas")

	// kubectl explain shows the doc comments.
	explain := mustKubectl(t, "explain", "exportersets.spec.minAvailable")
	assert.Contains(t, explain, "warm buffer")
}

// ctrlConfigUnique lets several managers in one process register a
// controller of the same name.
func ctrlConfigUnique() config.Controller {
	return config.Controller{SkipNameValidation: ptr.To(true)}
}

func TestEnvtestRolloutKeepsLeasedUntilRelease(t *testing.T) {
	ns := namespace(t)
	startManager(t, ns)
	createSet(t, sampleSet(ns, "roll", 2))
	ps := waitPodCount(t, ns, "roll", 2)
	readyAll(t, ps)
	waitStatus(t, ns, "roll", "2 available", func(st v1alpha1.ExporterSetStatus) bool { return st.AvailableReplicas == 2 })
	leasedPod, freePod := ps[0], ps[1]
	mustKubectl(t, "-n", ns, "label", "pod", leasedPod.Name, v1alpha1.LeaseLabel+"=ci-1", v1alpha1.UsedLabel+"=true")
	waitStatus(t, ns, "roll", "1 leased", func(st v1alpha1.ExporterSetStatus) bool { return st.LeasedReplicas == 1 })

	mustKubectl(t, "-n", ns, "patch", "exs", "roll", "--type=json", "-p",
		`[{"op":"replace","path":"/spec/template/spec/containers/0/image","value":"registry.invalid/os/debian:14"}]`)
	// One replacement is created; the outdated free pod stays until it is Ready.
	var fresh []corev1.Pod
	eventually(t, "a pod from the new template", func() (bool, string) {
		fresh = nil
		for _, p := range pods(t, ns, "roll") {
			if p.Spec.Containers[0].Image == "registry.invalid/os/debian:14" {
				fresh = append(fresh, p)
			}
		}
		return len(fresh) == 1, fmt.Sprintf("%d new pods", len(fresh))
	})
	assert.Contains(t, uids(pods(t, ns, "roll")), freePod.UID, "the outdated Ready pod stays until its replacement is Ready")
	readyAll(t, fresh)
	eventually(t, "outdated free pod replaced", func() (bool, string) {
		now := uids(pods(t, ns, "roll"))
		_, free := now[freePod.UID]
		_, leased := now[leasedPod.UID]
		return !free && leased && len(now) == 2, fmt.Sprintf("%v", now)
	})
	s := waitStatus(t, ns, "roll", "rolling out, 1 updated", func(st v1alpha1.ExporterSetStatus) bool { return st.UpdatedReplicas == 1 })
	assert.Equal(t, "RollingOut", condition(s.Status, v1alpha1.ConditionProgressing).Reason)

	// Release the outdated leased pod: it is replaced too.
	mustKubectl(t, "-n", ns, "label", "pod", leasedPod.Name, v1alpha1.LeaseLabel+"-")
	eventually(t, "outdated leased pod replaced after release", func() (bool, string) {
		now := pods(t, ns, "roll")
		n := 0
		for _, p := range now {
			if p.Spec.Containers[0].Image == "registry.invalid/os/debian:14" {
				n++
			}
		}
		return len(now) == 2 && n == 2, fmt.Sprintf("%d pods, %d new", len(now), n)
	})
	readyAll(t, pods(t, ns, "roll"))
	waitStatus(t, ns, "roll", "2 updated, complete", func(st v1alpha1.ExporterSetStatus) bool {
		c := condition(st, v1alpha1.ConditionProgressing)
		return st.UpdatedReplicas == 2 && st.AvailableReplicas == 2 && c != nil && c.Reason == "Complete"
	})
}

func TestEnvtestInvalidSelectorReported(t *testing.T) {
	ns := namespace(t)
	startManager(t, ns)
	createSet(t, sampleSet(ns, "mismatch", 2, func(s *v1alpha1.ExporterSet) {
		s.Spec.Template.Labels = map[string]string{"app": "other"}
	}))
	s := waitStatus(t, ns, "mismatch", "InvalidSelector", func(st v1alpha1.ExporterSetStatus) bool {
		c := condition(st, v1alpha1.ConditionReplicaFailure)
		return c != nil && c.Reason == "InvalidSelector"
	})
	assert.Contains(t, condition(s.Status, v1alpha1.ConditionReplicaFailure).Message, `selector "app=mismatch" does not match the template labels`)
	var l corev1.PodList
	require.NoError(t, env.client.List(context.Background(), &l, client.InNamespace(ns)))
	assert.Empty(t, l.Items, "a set whose selector misses its template creates nothing")
}

// The generated CRD (with the full pod template schema and its docs) is too
// big for client-side apply's last-applied annotation; the documented
// install is server-side apply.
func TestEnvtestCRDInstallsServerSide(t *testing.T) {
	root, err := qktest.RepoRoot()
	require.NoError(t, err)
	dir := filepath.Join(root, "config", "crd")
	out := mustKubectl(t, "apply", "--server-side", "--force-conflicts", "-f", dir)
	assert.Contains(t, out, "exportersets.qemu-kubelet.io serverside-applied")
	out, err = kubectl(t, "apply", "-f", dir)
	assert.Error(t, err, "client-side apply is expected to exceed the annotation limit: %s", out)
	assert.Contains(t, out, "Too long")
}

func TestEnvtestFailedCreateReported(t *testing.T) {
	ns := namespace(t)
	startManager(t, ns)
	// The CRD accepts the template; pod validation refuses the container name.
	createSet(t, sampleSet(ns, "refused", 3, func(s *v1alpha1.ExporterSet) {
		s.Spec.Template.Spec.Containers[0].Name = "Not_A_DNS_Label"
	}))
	s := waitStatus(t, ns, "refused", "ReplicaFailure FailedCreate", func(st v1alpha1.ExporterSetStatus) bool {
		c := condition(st, v1alpha1.ConditionReplicaFailure)
		return c != nil && c.Status == metav1.ConditionTrue && c.Reason == EventFailedCreate
	})
	msg := condition(s.Status, v1alpha1.ConditionReplicaFailure).Message
	assert.Contains(t, msg, "spec.containers[0].name")
	assert.Contains(t, msg, "0 of 3 done", "slow start stops after the first refused batch")
	eventually(t, "FailedCreate event", func() (bool, string) {
		var evs corev1.EventList
		require.NoError(t, env.client.List(context.Background(), &evs, client.InNamespace(ns)))
		for _, e := range evs.Items {
			if e.Reason == EventFailedCreate && e.InvolvedObject.Name == "refused" {
				return true, e.Message
			}
		}
		return false, fmt.Sprintf("%d events", len(evs.Items))
	})
	assert.Empty(t, pods(t, ns, "refused"))
}

// Several clients run the documented claim recipe on the same pod at once:
// exactly one wins.
func TestEnvtestConcurrentClaimsOneWinner(t *testing.T) {
	ns := namespace(t)
	startManager(t, ns)
	createSet(t, sampleSet(ns, "claim", 1))
	ps := waitPodCount(t, ns, "claim", 1)
	readyAll(t, ps)
	waitStatus(t, ns, "claim", "1 available", func(st v1alpha1.ExporterSetStatus) bool { return st.AvailableReplicas == 1 })
	rv := getPod(t, &ps[0]).ResourceVersion

	const clients = 4
	results := make(chan error, clients)
	for i := range clients {
		go func() {
			_, err := kubectl(t, "-n", ns, "label", "pod", ps[0].Name,
				fmt.Sprintf("%s=ci-%d", v1alpha1.LeaseLabel, i), v1alpha1.UsedLabel+"=true", "--resource-version="+rv)
			results <- err
		}()
	}
	wins := 0
	for range clients {
		if <-results == nil {
			wins++
		}
	}
	assert.Equal(t, 1, wins, "exactly one claim succeeds")
	holder := getPod(t, &ps[0]).Labels[v1alpha1.LeaseLabel]
	assert.Regexp(t, `^ci-\d$`, holder)
	// replicas 1, minAvailable 0: the leased pod is the whole target.
	waitStatus(t, ns, "claim", "1 leased", func(st v1alpha1.ExporterSetStatus) bool {
		return st.LeasedReplicas == 1 && st.AvailableReplicas == 0 && st.Replicas == 1
	})
}
