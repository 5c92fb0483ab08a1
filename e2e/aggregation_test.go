package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
)

// TestAggregatedMetrics runs metrics-server (built from its Go module) as
// the aggregated API metrics.k8s.io of a real control plane: metrics-server
// lives in a network namespace the test creates (the API server proxies to
// aggregated APIs only at non-loopback addresses), scrapes the qemu-kubelet
// node's /metrics/resource, and the real kubectl top and
// kube-controller-manager's HPA read VM pod metrics through the API server.
func TestAggregatedMetrics(t *testing.T) {
	ns := newNetns(t) // first: removed last, after everything using it
	root := ocitest.RepoRoot(t)
	tmp := t.TempDir()
	prebuild(t, kubeletPkg, ctrlPkg) // under way while the control plane starts
	c := cluster.StartT(t, cluster.Options{
		Aggregation:          true,
		APIServerBindAddress: "0.0.0.0", // also reachable at aggHostIP from the netns
		APIServerExtraIPs:    []string{aggHostIP},
		HPASyncPeriod:        5 * time.Second,
	})
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	refs := vmtest.PushTestImages(t, reg.Addr)
	bin := buildQemuKubelet(t)
	ctrlBin := goBuild(t, root, tmp, ctrlPkg)
	ctx := context.Background()

	scheme := runtime.NewScheme()
	require.NoError(t, clientgoscheme.AddToScheme(scheme))
	require.NoError(t, v1alpha1.AddToScheme(scheme))
	cl, err := client.New(c.RESTConfig(), client.Options{Scheme: scheme})
	require.NoError(t, err)
	out, err := c.Kubectl(ctx, "apply", "--server-side", "-f", filepath.Join(root, "config", "crd"))
	require.NoError(t, err, out)
	require.NoError(t, wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		return cl.List(ctx, &v1alpha1.ExporterSetList{}, client.InNamespace("default")) == nil, nil
	}), "ExporterSet CRD never served")

	// The node's kubelet API listens on the host's address, which the
	// netns reaches through the veth link (local delivery, no forwarding).
	a := newNodeAgent(t, c, bin, "qk-agg", "tcg", "")
	vmtest.ReapQEMU(t, a.dir)
	a.start()
	waitNode(t, c, a.name, 90*time.Second, "Ready=True", readyIs(corev1.ConditionTrue))
	startProcess(t, "exporterset-controller", filepath.Join(tmp, "exporterset-controller.log"), ctrlBin,
		"--kubeconfig", c.AdminKubeconfig(),
		"--metrics-bind-address", fmt.Sprintf("127.0.0.1:%d", testutil.FreePort(t)),
		"--health-probe-bind-address", fmt.Sprintf("127.0.0.1:%d", testutil.FreePort(t)),
		"-v", "2")
	e := &exsEnv{c: c, cl: cl, node: a.name, stateDir: filepath.Join(a.dir, "state"), image: refs[vmtest.VariantACPI], reg: reg.Addr, ns: "default"}
	// Runs before the controller and the node stop (cleanups are LIFO).
	t.Cleanup(func() { e.deleteAll(t) })

	msLog := startMetricsServer(t, c, ns, tmp)

	set := e.newSet("busy", e.image, 1, 0)
	e.createSet(t, set)
	_, pods := e.waitSet(t, "busy", 3*time.Minute, "1 Ready pod", func(s *v1alpha1.ExporterSet, pods []corev1.Pod) bool {
		return len(pods) == 1 && podReady(&pods[0])
	})
	first := pods[0].Name
	k := &kubectlEnv{t: t, c: c}

	t.Run("KubectlTopPodAndNode", func(t *testing.T) {
		k.t = t
		// metrics-server needs two scrapes for a CPU rate.
		out := k.eventually(2*time.Minute, first, "top", "pod", first, "--no-headers")
		f := strings.Fields(out)
		require.Len(t, f, 3, "NAME CPU MEMORY: %q", out)
		cpu, mem := resource.MustParse(f[1]), resource.MustParse(f[2])
		assert.Greater(t, mem.Value(), int64(20<<20), "QEMU's working set: %q", out)
		assert.GreaterOrEqual(t, cpu.MilliValue(), int64(0))
		t.Logf("kubectl top pod: %s", strings.TrimSpace(out))

		out = k.ok("top", "pod", first, "--containers", "--no-headers")
		f = strings.Fields(out)
		require.Len(t, f, 4, "POD NAME CPU MEMORY: %q", out)
		assert.Equal(t, "vm", f[1])

		out = k.eventually(time.Minute, a.name, "top", "node", a.name, "--no-headers")
		f = strings.Fields(out)
		require.Len(t, f, 5, "NAME CPU CPU%% MEMORY MEMORY%%: %q", out)
		ncpu, nmem := resource.MustParse(f[1]), resource.MustParse(f[3])
		assert.Positive(t, ncpu.MilliValue(), "node CPU: %q", out)
		assert.GreaterOrEqual(t, nmem.Value(), mem.Value(), "node memory covers the pod's: %q", out)
		t.Logf("kubectl top node: %s", strings.TrimSpace(out))

		// The same API as any client sees it, through the aggregator.
		raw := k.ok("get", "--raw", "/apis/metrics.k8s.io/v1beta1/namespaces/default/pods/"+first)
		assert.Contains(t, raw, `"name":"vm"`)
		if t.Failed() {
			t.Logf("metrics-server log:\n%s", readTail(msLog, 30))
		}
	})

	t.Run("HPAScalesExporterSetOnGuestCPU", func(t *testing.T) {
		k.t = t
		// 100m requested per VM; a guest burning its vCPU under TCG uses
		// up to a host core (330-850% of the request in runs on 2 shared
		// CPUs), an idle one about 10%: a target of 150% separates them.
		hpa := &autoscalingv2.HorizontalPodAutoscaler{
			ObjectMeta: metav1.ObjectMeta{Name: "busy", Namespace: "default"},
			Spec: autoscalingv2.HorizontalPodAutoscalerSpec{
				ScaleTargetRef: autoscalingv2.CrossVersionObjectReference{APIVersion: v1alpha1.GroupVersion.String(), Kind: "ExporterSet", Name: "busy"},
				MinReplicas:    ptr.To[int32](1),
				MaxReplicas:    2,
				Metrics: []autoscalingv2.MetricSpec{{
					Type: autoscalingv2.ResourceMetricSourceType,
					Resource: &autoscalingv2.ResourceMetricSource{Name: corev1.ResourceCPU,
						Target: autoscalingv2.MetricTarget{Type: autoscalingv2.UtilizationMetricType, AverageUtilization: ptr.To[int32](150)}},
				}},
				Behavior: &autoscalingv2.HorizontalPodAutoscalerBehavior{
					ScaleUp:   &autoscalingv2.HPAScalingRules{StabilizationWindowSeconds: ptr.To[int32](0)},
					ScaleDown: &autoscalingv2.HPAScalingRules{StabilizationWindowSeconds: ptr.To[int32](0)},
				},
			},
		}
		_, err := c.Client().AutoscalingV2().HorizontalPodAutoscalers("default").Create(ctx, hpa, metav1.CreateOptions{})
		require.NoError(t, err)
		t.Cleanup(func() {
			_ = c.Client().AutoscalingV2().HorizontalPodAutoscalers("default").Delete(context.Background(), "busy", metav1.DeleteOptions{})
		})
		hpaStatus := func() string {
			out, _ := k.run("get", "hpa", "busy", "-o", "jsonpath={.status}")
			return out
		}
		t.Cleanup(func() {
			if t.Failed() {
				ev, _ := k.run("get", "events", "--field-selector", "involvedObject.name=busy")
				t.Logf("HPA status: %s\nevents:\n%s\nmetrics-server log:\n%s", hpaStatus(), ev, readTail(msLog, 30))
			}
		})
		// The HPA reads the pod's CPU through metrics.k8s.io.
		require.True(t, waitFor(2*time.Minute, time.Second, func() bool {
			h, err := c.Client().AutoscalingV2().HorizontalPodAutoscalers("default").Get(ctx, "busy", metav1.GetOptions{})
			return err == nil && len(h.Status.CurrentMetrics) == 1 && h.Status.CurrentMetrics[0].Resource != nil &&
				h.Status.CurrentMetrics[0].Resource.Current.AverageUtilization != nil
		}), "HPA never read CPU metrics: %s", hpaStatus())
		t.Logf("idle: %s", strings.TrimSpace(k.ok("get", "hpa", "busy", "--no-headers")))

		port := testutil.FreePort(t)
		pf := k.start(nil, "port-forward", "pod/"+first, fmt.Sprintf("%d:8080", port))
		pf.waitFor(t, fmt.Sprintf("Forwarding from 127.0.0.1:%d", port), 30*time.Second)
		guest := func(path, want string) {
			t.Helper()
			resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d%s", port, path))
			require.NoError(t, err, path)
			defer resp.Body.Close()
			body, _ := io.ReadAll(resp.Body)
			require.Equal(t, http.StatusOK, resp.StatusCode, "%s: %s", path, body)
			require.Contains(t, string(body), want, path)
		}
		t0 := time.Now()
		guest("/cgi-bin/burn?900", "QK-BURN 900")
		t.Cleanup(func() { // never leave a guest burning the shared CPUs
			_, _ = http.Get(fmt.Sprintf("http://127.0.0.1:%d/cgi-bin/idle", port))
		})
		e.waitSet(t, "busy", 4*time.Minute, "scaled up to 2 by the HPA, both Ready", func(s *v1alpha1.ExporterSet, pods []corev1.Pod) bool {
			return s.Spec.Replicas != nil && *s.Spec.Replicas == 2 && len(pods) == 2 && podReady(&pods[0]) && podReady(&pods[1])
		})
		up := time.Since(t0)
		t.Logf("busy: %s (scaled up and Ready %s after the burn started)", strings.TrimSpace(k.ok("get", "hpa", "busy", "--no-headers")), up.Round(time.Second))

		guest("/cgi-bin/idle", "QK-IDLE")
		t1 := time.Now()
		_, pods := e.waitSet(t, "busy", 4*time.Minute, "scaled down to 1 by the HPA", func(s *v1alpha1.ExporterSet, pods []corev1.Pod) bool {
			return s.Spec.Replicas != nil && *s.Spec.Replicas == 1 && len(pods) == 1
		})
		t.Logf("idle again: %s (scaled down %s after the burn stopped)", strings.TrimSpace(k.ok("get", "hpa", "busy", "--no-headers")), time.Since(t1).Round(time.Second))
		assert.Equal(t, first, pods[0].Name, "the newer, idle pod goes first")
		ev := k.ok("get", "events", "--field-selector", "involvedObject.kind=HorizontalPodAutoscaler,involvedObject.name=busy", "-o", "custom-columns=REASON:.reason,MSG:.message", "--no-headers")
		assert.Contains(t, ev, "New size: 2")
		assert.Contains(t, ev, "New size: 1")
	})
}
