package controller

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
)

// startUpstreamManager runs both reconcilers (ours and the upstream API's,
// as cmd/exporterset-controller does) for one namespace until the test ends.
func startUpstreamManager(t *testing.T, ns string, opts ...func(*UpstreamReconciler)) *UpstreamReconciler {
	t.Helper()
	mgr, err := ctrl.NewManager(env.cfg, ctrl.Options{
		Scheme:                 env.scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Cache:                  cache.Options{DefaultNamespaces: map[string]cache.Config{ns: {}}},
		Controller:             ctrlConfigUnique(),
	})
	require.NoError(t, err)
	require.NoError(t, NewReconciler(mgr.GetClient(), mgr.GetEventRecorder("exporterset-controller"), nil).SetupWithManager(mgr, 2))
	up, err := UpstreamServed(mgr)
	require.NoError(t, err)
	require.True(t, up, "envtest serves virtualtarget.jumpstarter.dev")
	u := NewUpstreamReconciler(mgr.GetClient(), mgr.GetEventRecorder("exporterset-controller"), "")
	for _, o := range opts {
		o(u)
	}
	require.NoError(t, u.SetupWithManager(mgr, 2))
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
	return u
}

func createUpstream(t *testing.T, objs ...client.Object) {
	t.Helper()
	for _, o := range objs {
		require.NoError(t, env.client.Create(context.Background(), o))
	}
}

func vtClass(ns, name, provisioner, params string) *vtv1.VirtualTargetClass {
	c := &vtv1.VirtualTargetClass{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: vtv1.VirtualTargetClassSpec{Provisioner: provisioner}}
	if params != "" {
		c.Spec.Parameters = &apiextv1.JSON{Raw: []byte(params)}
	}
	return c
}

func vtSet(ns, name, class string, minReplicas int32) *vtv1.ExporterSet {
	return &vtv1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: vtv1.ExporterSetSpec{VirtualTargetClassName: class, MinReplicas: minReplicas,
			Selector: metav1.LabelSelector{MatchLabels: map[string]string{"set": name}},
			Template: vtv1.ExporterSetTemplate{Metadata: vtv1.TemplateMetadata{Labels: map[string]string{"set": name}}}}}
}

func podNames(ps []corev1.Pod) []string {
	out := make([]string, len(ps))
	for i := range ps {
		out[i] = ps[i].Name
	}
	return out
}

func upstreamPods(t *testing.T, ns, set string) []corev1.Pod {
	t.Helper()
	var l corev1.PodList
	require.NoError(t, env.client.List(context.Background(), &l, client.InNamespace(ns), client.MatchingLabels{UpstreamLabel: set}))
	var out []corev1.Pod
	for _, p := range l.Items {
		if p.DeletionTimestamp == nil {
			out = append(out, p)
		}
	}
	return out
}

func waitUpstream(t *testing.T, ns, name, what string, cond func(vtv1.ExporterSetStatus) bool) *vtv1.ExporterSet {
	t.Helper()
	var s vtv1.ExporterSet
	eventually(t, what, func() (bool, string) {
		require.NoError(t, env.client.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, &s))
		return cond(s.Status), fmt.Sprintf("%+v", s.Status)
	})
	return &s
}

// TestEnvtestUpstreamProvisioner: an upstream-API set whose class names
// our provisioner gets VM pods built from the class and its status in
// upstream's fields and conditions; a set of class qemu.jumpstarter.dev
// in the same namespace is never touched (same resourceVersion, no pod, no
// event), nor is a set whose class does not exist; a set without an image
// is Degraded and gets no pod. Scaled down with a short scaleDownCooldown,
// our set deletes its surplus pod once the cooldown elapsed.
func TestEnvtestUpstreamProvisioner(t *testing.T) {
	ns := namespace(t)
	ctx := context.Background()
	// Theirs first: by the time ours is served, the initial list has
	// queued both.
	createUpstream(t, vtClass(ns, "theirs", "qemu.jumpstarter.dev", `{"arch":"x86_64"}`), vtSet(ns, "other", "theirs", 2),
		vtSet(ns, "orphan", "nowhere", 1))
	var other vtv1.ExporterSet
	require.NoError(t, env.client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "other"}, &other))
	u := startUpstreamManager(t, ns)

	createUpstream(t, vtClass(ns, "ours", vtv1.DefaultProvisioner,
		`{"arch":"aarch64","qemuKubelet":{"image":"reg.invalid/os:1"},"resources":{"cpu":"2","memory":"1Gi"}}`))
	mine := vtSet(ns, "mine", "ours", 2)
	mine.Spec.MaxReplicas = ptr.To[int32](3)
	createUpstream(t, mine)

	// Pods from the class: the virtual node's placement, arch, size, image.
	var ps []corev1.Pod
	eventually(t, "2 pods of mine", func() (bool, string) {
		ps = upstreamPods(t, ns, "mine")
		return len(ps) == 2, fmt.Sprintf("%d pods", len(ps))
	})
	for _, p := range ps {
		assert.Equal(t, "reg.invalid/os:1", p.Spec.Containers[0].Image)
		assert.Equal(t, map[string]string{"type": "virtual-kubelet", "kubernetes.io/arch": "arm64"}, p.Spec.NodeSelector)
		assert.Contains(t, p.Spec.Tolerations, virtualNodeToleration)
		assert.Equal(t, "1Gi", ptr.To(p.Spec.Containers[0].Resources.Limits[corev1.ResourceMemory]).String())
		ref := metav1.GetControllerOf(&p)
		require.NotNil(t, ref)
		assert.Equal(t, vtv1.GroupVersion.String(), ref.APIVersion)
		assert.Equal(t, "mine", ref.Name)
	}
	s := waitUpstream(t, ns, "mine", "2 pending pods in the status", func(st vtv1.ExporterSetStatus) bool {
		return st.Replicas == 2 && st.PodsPending == 2 && len(st.Conditions) == 4
	})
	for _, typ := range []string{vtv1.ExporterSetConditionAvailable, vtv1.ExporterSetConditionProgressing,
		vtv1.ExporterSetConditionDegraded, vtv1.ExporterSetConditionScalingLimited} {
		assert.NotNil(t, meta.FindStatusCondition(s.Status.Conditions, typ), typ)
	}
	assert.True(t, meta.IsStatusConditionFalse(s.Status.Conditions, vtv1.ExporterSetConditionDegraded))
	assert.True(t, meta.IsStatusConditionFalse(s.Status.Conditions, vtv1.ExporterSetConditionScalingLimited))
	assert.Equal(t, "set=mine", s.Status.Selector, "spec.selector serialized, as upstream writes it")
	// The scale subresource (HPA) reads it, and it selects the set's pods.
	raw := mustKubectl(t, "get", "--raw", fmt.Sprintf("/apis/%s/namespaces/%s/exportersets/mine/scale", vtv1.GroupVersion, ns))
	var scale struct {
		Spec   struct{ Replicas int32 }
		Status struct{ Selector string }
	}
	require.NoError(t, json.Unmarshal([]byte(raw), &scale), raw)
	assert.Equal(t, int32(3), scale.Spec.Replicas, "spec.maxReplicas")
	assert.Equal(t, "set=mine", scale.Status.Selector)
	sel, err := labels.Parse(scale.Status.Selector)
	require.NoError(t, err)
	var selected corev1.PodList
	require.NoError(t, env.client.List(context.Background(), &selected, client.InNamespace(ns), client.MatchingLabelsSelector{Selector: sel}))
	assert.ElementsMatch(t, podNames(ps), podNames(selected.Items), "the scale selector selects the set's pods")

	// The kubelet's part: Running and Ready.
	readyAll(t, ps)
	s = waitUpstream(t, ns, "mine", "2 ready and running", func(st vtv1.ExporterSetStatus) bool {
		return st.ReadyReplicas == 2 && st.PodsRunning == 2 && st.UnavailableReplicas == 0
	})
	assert.True(t, meta.IsStatusConditionTrue(s.Status.Conditions, vtv1.ExporterSetConditionAvailable))
	// Each pod has its Exporter, not yet Online (no Jumpstarter here).
	assert.Equal(t, int32(2), s.Status.ExportersOffline)

	// Scaled down with a short cooldown: the surplus pod goes once it has
	// elapsed (the cooldown's start is kept by the reconciler: upstream's
	// status has no field for it).
	before := client.MergeFrom(s.DeepCopy())
	s.Spec.MinReplicas, s.Spec.ScaleDownCooldown = 1, &metav1.Duration{Duration: 2 * time.Second}
	require.NoError(t, env.client.Patch(ctx, s, before))
	eventually(t, "the surplus pod of mine deleted after the cooldown", func() (bool, string) {
		left := upstreamPods(t, ns, "mine")
		return len(left) == 1, fmt.Sprintf("%d pods", len(left))
	})
	left := upstreamPods(t, ns, "mine")
	assert.Contains(t, []string{ps[0].Name, ps[1].Name}, left[0].Name, "one of the two pods stays; none is created")
	waitUpstream(t, ns, "mine", "1 replica in the status", func(st vtv1.ExporterSetStatus) bool { return st.Replicas == 1 })

	// Without an image: a VM of an empty disk of resources.storage, for
	// the lease holder to flash.
	createUpstream(t, vtClass(ns, "bare", vtv1.DefaultProvisioner, `{"resources":{"storage":"8Gi"}}`), vtSet(ns, "noimage", "bare", 1))
	eventually(t, "the empty-disk pod of noimage", func() (bool, string) {
		ps := upstreamPods(t, ns, "noimage")
		return len(ps) == 1, fmt.Sprintf("%d pods", len(ps))
	})
	c := upstreamPods(t, ns, "noimage")[0].Spec.Containers[0]
	assert.Equal(t, v1alpha1.EmptyDiskImage, c.Image)
	assert.Equal(t, "8Gi", ptr.To(c.Resources.Limits[corev1.ResourceEphemeralStorage]).String())
	s = waitUpstream(t, ns, "noimage", "Degraded False", func(st vtv1.ExporterSetStatus) bool {
		return meta.IsStatusConditionFalse(st.Conditions, vtv1.ExporterSetConditionDegraded)
	})
	// An empty disk too small: Degraded, saying why; no pod.
	createUpstream(t, vtClass(ns, "tiny", vtv1.DefaultProvisioner, `{"resources":{"storage":"100Ki"}}`), vtSet(ns, "tinydisk", "tiny", 1))
	s = waitUpstream(t, ns, "tinydisk", "Degraded InvalidParameters", func(st vtv1.ExporterSetStatus) bool {
		c := meta.FindStatusCondition(st.Conditions, vtv1.ExporterSetConditionDegraded)
		return c != nil && c.Status == metav1.ConditionTrue && c.Reason == ReasonInvalidParameters
	})
	assert.Contains(t, meta.FindStatusCondition(s.Status.Conditions, vtv1.ExporterSetConditionDegraded).Message, "100Ki: an empty disk is 1Mi to 64Ti")
	assert.Empty(t, upstreamPods(t, ns, "tinydisk"))

	// The other provisioner's set, planned again by hand now that the
	// controller ran: still untouched.
	_, err = u.Reconcile(ctx, ctrl.Request{NamespacedName: types.NamespacedName{Namespace: ns, Name: "other"}})
	require.NoError(t, err)
	for _, name := range []string{"other", "orphan"} {
		var now vtv1.ExporterSet
		require.NoError(t, env.client.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, &now))
		if name == "other" {
			assert.Equal(t, other.ResourceVersion, now.ResourceVersion, "qemu.jumpstarter.dev's set is never written")
		}
		assert.Empty(t, now.Status.Conditions, name)
		assert.Empty(t, upstreamPods(t, ns, name), name)
	}
	var evs eventsv1.EventList
	require.NoError(t, env.client.List(ctx, &evs, client.InNamespace(ns)))
	var regarding []string
	for _, e := range evs.Items {
		regarding = append(regarding, e.Regarding.Name)
	}
	assert.NotContains(t, regarding, "other")
	assert.NotContains(t, regarding, "orphan")
	assert.Contains(t, regarding, "mine", "our set's creates were recorded (the event list is read)")
}

// TestEnvtestUpstreamLeaseFromZero: an upstream set of our provisioner at
// minReplicas 0 keeps a cold Exporter (owned by the set, the template's
// labels) and no pod; a pending Lease selecting those labels makes one
// gated pod with its Exporter (owned by the pod, upstream's set label);
// once Jumpstarter issued the credential, the Secret exporter-config-<pod>
// holds the endpoint, token and the CA of the namespace's
// jumpstarter-service-ca-cert, in our keys and in upstream's config.yaml
// (exitOnLeaseEnd unless InPlaceReuse), and the gate goes. ExitAndReplace: the
// lease's end retires the pod and its Exporter (back to the cold one);
// InPlaceReuse keeps the pod and its Exporter.
func TestEnvtestUpstreamLeaseFromZero(t *testing.T) {
	ns := namespace(t)
	ctx := context.Background()
	startUpstreamManager(t, ns, func(u *UpstreamReconciler) { u.DrainDelay = 300 * time.Millisecond })
	createUpstream(t, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: upstreamCAConfigMap}, Data: map[string]string{upstreamCAKey: testCA}},
		vtClass(ns, "ours", vtv1.DefaultProvisioner, `{"qemuKubelet":{"image":"reg.invalid/os:1"}}`))
	for _, tc := range []struct {
		name     string
		strategy vtv1.RecycleStrategy
	}{{"exit", vtv1.RecycleStrategyExitAndReplace}, {"reuse", vtv1.RecycleStrategyInPlaceReuse}} {
		set := vtSet(ns, tc.name, "ours", 0)
		set.Spec.RecycleStrategy = tc.strategy
		createUpstream(t, set)
		eventually(t, tc.name+": cold exporter", func() (bool, string) {
			e, err := getExporter(t, ns, tc.name+"-cold")
			if err != nil {
				return false, err.Error()
			}
			ref := metav1.GetControllerOf(e)
			return e.IsEnabled() && e.Labels["set"] == tc.name && e.Labels[UpstreamExporterSetLabel] == tc.name &&
				ref != nil && ref.APIVersion == vtv1.GroupVersion.String() && ref.Name == tc.name, fmt.Sprint(e.Labels, ref)
		})
		assert.Empty(t, upstreamPods(t, ns, tc.name), "minReplicas 0: no pod before a lease waits")
		createOrphanExporter(t, upstreamTarget(set, false, ""), tc.name+"-gone1")
		eventually(t, tc.name+": orphan Exporter deleted", exporterGone(t, ns, tc.name+"-gone1"))

		lease := "lease-" + tc.name
		createLease(t, ns, lease, map[string]string{"set": tc.name})
		var p corev1.Pod
		eventually(t, tc.name+": one pod for the lease", func() (bool, string) {
			ps := upstreamPods(t, ns, tc.name)
			if len(ps) == 1 {
				p = ps[0]
			}
			return len(ps) == 1, fmt.Sprintf("%d pods", len(ps))
		})
		assert.True(t, hasGate(&p), "pod created without the scheduling gate")
		assert.Equal(t, tc.name, p.Labels[UpstreamExporterSetLabel])
		assert.Equal(t, upstreamSecretName(p.Name), p.Annotations[v1alpha1.JumpstarterSecretAnnotation])
		var e *jsv1.Exporter
		eventually(t, tc.name+": the pod's Exporter", func() (bool, string) {
			var err error
			e, err = getExporter(t, ns, p.Name)
			return err == nil, fmt.Sprint(err)
		})
		assert.Equal(t, tc.name, e.Labels["set"], "the template's labels: Leases select on them")
		assert.Equal(t, p.UID, metav1.GetControllerOf(e).UID, "the pod's Exporter is owned by the pod")

		issueCredential(t, ns, p.Name)
		eventually(t, tc.name+": gate removed", func() (bool, string) {
			q := getPod(t, &p)
			return !hasGate(q), fmt.Sprint(q.Spec.SchedulingGates)
		})
		var sec corev1.Secret
		require.NoError(t, env.client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "exporter-config-" + p.Name}, &sec))
		assert.Equal(t, "jumpstarter-own.example:8082", string(sec.Data[v1alpha1.JumpstarterSecretEndpoint]), "the Exporter's status.endpoint")
		assert.Equal(t, "tok-"+p.Name, string(sec.Data[v1alpha1.JumpstarterSecretToken]))
		assert.Equal(t, testCA, string(sec.Data[v1alpha1.JumpstarterSecretCA]), "the CA of "+upstreamCAConfigMap)
		assert.Equal(t, p.Name, string(sec.Data[v1alpha1.JumpstarterSecretName]))
		assert.Equal(t, tc.name, sec.Labels[UpstreamExporterSetLabel])
		doc, err := jsv1.ParseExporterConfig(sec.Data[jsv1.ExporterConfigSecretKey])
		require.NoError(t, err, "config.yaml: upstream's ExporterConfig")
		assert.Equal(t, jsv1.ExporterConfigMetadata{Name: p.Name, Namespace: ns}, doc.Metadata)
		assert.Equal(t, "jumpstarter-own.example:8082", doc.Endpoint)
		assert.Equal(t, "tok-"+p.Name, doc.Token)
		require.NotNil(t, doc.TLS)
		assert.Equal(t, base64.StdEncoding.EncodeToString([]byte(testCA)), doc.TLS.CA, "tls.ca: the CA, base64 encoded")
		assert.Equal(t, tc.strategy == vtv1.RecycleStrategyExitAndReplace, doc.ExitOnLeaseEnd, "exitOnLeaseEnd unless InPlaceReuse")

		readyAll(t, []corev1.Pod{*getPod(t, &p)})
		updateExporterStatus(t, ns, p.Name, func(e *jsv1.Exporter) {
			meta.SetStatusCondition(&e.Status.Conditions, metav1.Condition{Type: jsv1.ExporterConditionOnline, Status: metav1.ConditionTrue, Reason: "Online", Message: "registered"})
		})
		assignLease(t, ns, lease, p.Name)
		waitUpstream(t, ns, tc.name, tc.name+": leased 1, exporter active", func(st vtv1.ExporterSetStatus) bool {
			return st.LeasedReplicas == 1 && st.ExportersActive == 1
		})
		endLease(t, ns, lease, p.Name)
		if tc.strategy == vtv1.RecycleStrategyInPlaceReuse {
			waitUpstream(t, ns, tc.name, tc.name+": released, idle", func(st vtv1.ExporterSetStatus) bool {
				return st.LeasedReplicas == 0 && st.ExportersIdle == 1
			})
			ps := upstreamPods(t, ns, tc.name)
			require.Len(t, ps, 1, "InPlaceReuse keeps the pod")
			assert.Equal(t, p.UID, ps[0].UID)
			e, err := getExporter(t, ns, p.Name)
			require.NoError(t, err)
			assert.True(t, e.IsEnabled(), "InPlaceReuse keeps the Exporter enabled")
			continue
		}
		eventually(t, tc.name+": the used pod and its Exporter retired", func() (bool, string) {
			_, err := getExporter(t, ns, p.Name)
			left := upstreamPods(t, ns, tc.name)
			return len(left) == 0 && apierrors.IsNotFound(err), fmt.Sprintf("%d pods, exporter: %v", len(left), err)
		})
		_, err = getExporter(t, ns, tc.name+"-cold")
		assert.NoError(t, err, "the cold exporter stays")
	}
}
