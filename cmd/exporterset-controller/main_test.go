package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zapcore"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/controller"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// controlPlaneBin returns KUBEBUILDER_ASSETS or builds the control plane
// (cached) with hack/build-control-plane.sh.
func controlPlaneBin(t *testing.T, root string) string {
	t.Helper()
	if d := os.Getenv("KUBEBUILDER_ASSETS"); d != "" {
		return d
	}
	cmd := exec.Command(filepath.Join(root, "hack", "build-control-plane.sh"))
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	require.NoError(t, err, "hack/build-control-plane.sh")
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	return lines[len(lines)-1]
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().String()
}

func httpGet(url string) (int, string, error) {
	resp, err := http.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// TestRunAgainstRealAPIServer runs the controller's wiring (manager, leader
// election, metrics and health endpoints) against a real kube-apiserver.
func TestRunAgainstRealAPIServer(t *testing.T) {
	testutil.SkipIfShort(t, "a control plane (envtest)")
	ctrl.SetLogger(zap.New(zap.WriteTo(os.Stderr), zap.Level(zapcore.ErrorLevel)))
	root := testutil.MustRepoRoot(t)
	testEnv := &envtest.Environment{
		BinaryAssetsDirectory: controlPlaneBin(t, root),
		CRDDirectoryPaths:     []string{filepath.Join(root, "config", "crd")},
		ErrorIfCRDPathMissing: true,
	}
	cfg, err := testEnv.Start()
	require.NoError(t, err)
	stop := func() {
		if err := testEnv.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "stop envtest:", err)
		}
	}
	t.Cleanup(stop)
	t.Cleanup(testutil.GuardCleanup("exporterset-controller tests", stop))

	scheme := runtime.NewScheme()
	require.NoError(t, clientgoscheme.AddToScheme(scheme))
	require.NoError(t, v1alpha1.AddToScheme(scheme))
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	require.NoError(t, err)

	o := options{metricsAddr: freeAddr(t), healthAddr: freeAddr(t), leaderElect: true,
		leaderElectionNamespace: "default", leaderElectionID: "exs-test", workers: 2, qps: 50, burst: 100}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx, cfg, o) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			assert.NoError(t, err)
		case <-time.After(time.Minute):
			t.Error("controller did not stop")
		}
	})

	set := &v1alpha1.ExporterSet{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "smoke"},
		Spec: v1alpha1.ExporterSetSpec{
			Replicas: ptr.To[int32](2),
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "smoke"}},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "smoke"}},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "vm", Image: "registry.invalid/os:1"}}},
			},
		},
	}
	require.NoError(t, c.Create(context.Background(), set))

	want := `qemu_kubelet_exporterset_desired_replicas{exporterset="smoke",namespace="default"} 2`
	deadline := time.Now().Add(time.Minute)
	var last string
	for {
		var pods corev1.PodList
		require.NoError(t, c.List(context.Background(), &pods, client.InNamespace("default"), client.MatchingLabels{"app": "smoke"}))
		code, body, err := httpGet("http://" + o.metricsAddr + "/metrics")
		if len(pods.Items) == 2 && err == nil && code == http.StatusOK && strings.Contains(body, want) {
			break
		}
		last = fmt.Sprintf("%d pods, metrics %d %v", len(pods.Items), code, err)
		if time.Now().After(deadline) {
			t.Fatalf("controller did not reconcile: %s", last)
		}
		time.Sleep(100 * time.Millisecond)
	}

	for _, path := range []string{"/healthz", "/readyz"} {
		code, body, err := httpGet("http://" + o.healthAddr + path)
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, code, "%s: %s", path, body)
	}
	var lease coordinationv1.Lease
	require.NoError(t, c.Get(context.Background(), client.ObjectKey{Namespace: "default", Name: "exs-test"}, &lease))
	require.NotNil(t, lease.Spec.HolderIdentity)
	assert.NotEmpty(t, *lease.Spec.HolderIdentity, "leader election holds the Lease")
}

// TestRunAsUpstreamProvisioner runs the binary's wiring as Jumpstarter's
// operator starts a provisioner: only upstream's CRDs installed (ours are
// not), --provisioner, --leader-elect, --metrics-bind-address=0 and
// NAMESPACE. The set of its namespace and provisioner gets pods; a set of
// another namespace, and one of the default provisioner name, get none.
func TestRunAsUpstreamProvisioner(t *testing.T) {
	testutil.SkipIfShort(t, "a control plane (envtest)")
	ctrl.SetLogger(zap.New(zap.WriteTo(os.Stderr), zap.Level(zapcore.ErrorLevel)))
	root := testutil.MustRepoRoot(t)
	testEnv := &envtest.Environment{
		BinaryAssetsDirectory: controlPlaneBin(t, root),
		CRDDirectoryPaths:     []string{testutil.VirtualTargetCRDs(root), testutil.JumpstarterCRDs(root)},
		ErrorIfCRDPathMissing: true,
	}
	cfg, err := testEnv.Start()
	require.NoError(t, err)
	stop := func() {
		if err := testEnv.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "stop envtest:", err)
		}
	}
	t.Cleanup(stop)
	t.Cleanup(testutil.GuardCleanup("exporterset-controller tests", stop))

	scheme := runtime.NewScheme()
	require.NoError(t, clientgoscheme.AddToScheme(scheme))
	require.NoError(t, vtv1.AddToScheme(scheme))
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "lab"}}))
	const params = `{"qemuKubelet":{"image":"registry.invalid/os:1"}}`
	for _, o := range []client.Object{
		&vtv1.VirtualTargetClass{ObjectMeta: metav1.ObjectMeta{Namespace: "lab", Name: "mine"},
			Spec: vtv1.VirtualTargetClassSpec{Provisioner: "lab.example/vms", Parameters: &apiextv1.JSON{Raw: []byte(params)}}},
		&vtv1.VirtualTargetClass{ObjectMeta: metav1.ObjectMeta{Namespace: "lab", Name: "default-name"},
			Spec: vtv1.VirtualTargetClassSpec{Provisioner: vtv1.DefaultProvisioner, Parameters: &apiextv1.JSON{Raw: []byte(params)}}},
		&vtv1.VirtualTargetClass{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "mine"},
			Spec: vtv1.VirtualTargetClassSpec{Provisioner: "lab.example/vms", Parameters: &apiextv1.JSON{Raw: []byte(params)}}},
		upstreamSet("lab", "served", "mine"), upstreamSet("lab", "not-mine", "default-name"), upstreamSet("default", "elsewhere", "mine"),
	} {
		require.NoError(t, c.Create(ctx, o))
	}

	t.Setenv("NAMESPACE", "lab")
	o := options{metricsAddr: "0", healthAddr: freeAddr(t), leaderElect: true, provisioner: "lab.example/vms", upstreamOnly: true,
		leaderElectionNamespace: "lab", leaderElectionID: "exs-upstream-test", workers: 2, qps: 50, burst: 100,
		registry: prometheus.NewRegistry()}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- run(runCtx, cfg, o) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			assert.NoError(t, err)
		case <-time.After(time.Minute):
			t.Error("controller did not stop")
		}
	})

	count := func(ns, set string) int {
		var pods corev1.PodList
		require.NoError(t, c.List(ctx, &pods, client.InNamespace(ns), client.MatchingLabels{controller.UpstreamLabel: set}))
		return len(pods.Items)
	}
	deadline := time.Now().Add(time.Minute)
	for count("lab", "served") != 1 { // waits for the served set's pod
		if time.Now().After(deadline) {
			var s vtv1.ExporterSet
			_ = c.Get(ctx, client.ObjectKey{Namespace: "lab", Name: "served"}, &s)
			t.Fatalf("the set of our provisioner has %d pods after a minute, want 1; its conditions: %+v", count("lab", "served"), s.Status.Conditions)
		}
		time.Sleep(100 * time.Millisecond)
	}
	code, body, err := httpGet("http://" + o.healthAddr + "/healthz")
	require.NoError(t, err)
	assert.Equal(t, http.StatusOK, code, body)
	assert.Zero(t, count("lab", "not-mine"), "a class of another provisioner name")
	assert.Zero(t, count("default", "elsewhere"), "a namespace outside NAMESPACE")
	for _, key := range []client.ObjectKey{{Namespace: "lab", Name: "not-mine"}, {Namespace: "default", Name: "elsewhere"}} {
		var s vtv1.ExporterSet
		require.NoError(t, c.Get(ctx, key, &s))
		assert.Empty(t, s.Status.Conditions, "%s is never written", key)
	}
}

func upstreamSet(ns, name, class string) *vtv1.ExporterSet {
	return &vtv1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: vtv1.ExporterSetSpec{VirtualTargetClassName: class, MinReplicas: 1,
			Selector: metav1.LabelSelector{MatchLabels: map[string]string{"set": name}},
			Template: vtv1.ExporterSetTemplate{Metadata: vtv1.TemplateMetadata{Labels: map[string]string{"set": name}}}}}
}

// TestFlagsProvisionerServesUpstreamOnly: --provisioner on the command line
// (as Jumpstarter's operator starts a provisioner) serves upstream's API
// only; without it, the default provisioner name and both APIs.
func TestFlagsProvisionerServesUpstreamOnly(t *testing.T) {
	for _, tc := range []struct {
		args []string
		only bool
		name string
	}{
		{nil, false, vtv1.DefaultProvisioner},
		{[]string{"--provisioner=qemu-kubelet.io", "--leader-elect", "--health-probe-bind-address=:8081", "--metrics-bind-address=0"}, true, "qemu-kubelet.io"},
		{[]string{"--provisioner", "lab.example/vms"}, true, "lab.example/vms"},
	} {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		var o options
		addFlags(fs, &o)
		require.NoError(t, fs.Parse(tc.args))
		flagsParsed(fs, &o)
		assert.Equal(t, tc.only, o.upstreamOnly, "%v", tc.args)
		assert.Equal(t, tc.name, o.provisioner, "%v", tc.args)
	}
}
