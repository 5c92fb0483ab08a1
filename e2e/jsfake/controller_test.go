package jsfake

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/controller"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
)

// fakeNode plays the node for the set's pods: a pod released from its
// scheduling gate "boots" after bootDelay, i.e. its exporter connects to
// jstest with the pod's exporter Secret (the contract of
// v1alpha1.JumpstarterSecretAnnotation) and the pod turns Ready; a deleted
// pod's exporter disconnects.
type fakeNode struct {
	c         client.Client
	ns, app   string
	bootDelay time.Duration
	mu        sync.Mutex
	running   map[types.UID]func()
	booted    map[string]time.Time
}

func (n *fakeNode) run(ctx context.Context, t testing.TB) {
	for ctx.Err() == nil {
		var l corev1.PodList
		if err := n.c.List(ctx, &l, client.InNamespace(n.ns), client.MatchingLabels{"app": n.app}); err == nil {
			live := map[types.UID]bool{}
			for i := range l.Items {
				p := &l.Items[i]
				if p.DeletionTimestamp != nil || len(p.Spec.SchedulingGates) > 0 {
					continue
				}
				live[p.UID] = true
				n.mu.Lock()
				_, ok := n.running[p.UID]
				n.mu.Unlock()
				if !ok {
					n.boot(ctx, t, p)
				}
			}
			n.mu.Lock()
			for uid, stop := range n.running {
				if !live[uid] {
					stop()
					delete(n.running, uid)
				}
			}
			n.mu.Unlock()
		}
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
	n.mu.Lock()
	for _, stop := range n.running {
		stop()
	}
	n.mu.Unlock()
}

func (n *fakeNode) boot(ctx context.Context, t testing.TB, p *corev1.Pod) {
	var sec corev1.Secret
	if err := n.c.Get(ctx, types.NamespacedName{Namespace: p.Namespace, Name: p.Annotations[v1alpha1.JumpstarterSecretAnnotation]}, &sec); err != nil {
		t.Errorf("pod %s released from its gate without its exporter Secret: %v", p.Name, err)
		n.running[p.UID] = func() {}
		return
	}
	time.Sleep(n.bootDelay)
	d := sec.Data
	stop, err := goOnline(ctx, string(d[v1alpha1.JumpstarterSecretEndpoint]), string(d[v1alpha1.JumpstarterSecretToken]),
		string(d[v1alpha1.JumpstarterSecretNamespace]), string(d[v1alpha1.JumpstarterSecretName]))
	if err != nil {
		t.Errorf("exporter of pod %s: %v", p.Name, err)
		stop = func() {}
	}
	p.Status.Phase = corev1.PodRunning
	p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: metav1.Now()}}
	_ = n.c.Status().Update(ctx, p)
	n.mu.Lock()
	n.running[p.UID] = stop
	n.booted[p.Name] = time.Now()
	n.mu.Unlock()
}

func startController(t testing.TB, e *apiEnv, ns string) {
	t.Helper()
	mgr, err := ctrl.NewManager(e.cfg, ctrl.Options{
		Scheme:                 e.scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Cache:                  cache.Options{DefaultNamespaces: map[string]cache.Config{ns: {}}},
		Controller:             config.Controller{SkipNameValidation: ptr.To(true)},
	})
	require.NoError(t, err)
	m, err := controller.NewMetrics(prometheus.NewRegistry())
	require.NoError(t, err)
	r := controller.NewReconciler(mgr.GetClient(), mgr.GetEventRecorder("exporterset-controller"), m)
	r.DrainDelay = 500 * time.Millisecond
	require.NoError(t, r.SetupWithManager(mgr, 2))
	require.True(t, r.Jumpstarter)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
}

// TestExporterSetFromZeroThroughJumpstarter runs the ExporterSet controller
// against the test Jumpstarter (jsfake + jstest) with a fake node whose
// "VMs" are protocol-level exporters using the controller's Secrets: a Lease
// on an empty set waits (cold exporter), a pod boots for it, its exporter
// comes online and gets the Lease; release recycles the pod, and a warm
// set serves a second Lease without booting.
func TestExporterSetFromZeroThroughJumpstarter(t *testing.T) {
	if testing.Short() {
		t.Skip("needs the control plane")
	}
	exporterSetFromZeroThroughJumpstarter(t, &env)
}

func exporterSetFromZeroThroughJumpstarter(t *testing.T, env *apiEnv) {
	ns := env.namespace(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ctl, err := jstest.Start(jstest.Options{Insecure: true})
	require.NoError(t, err)
	defer ctl.Close()
	fake := &Fake{Client: env.client, Ctl: ctl, Namespace: ns, Interval: 50 * time.Millisecond, Log: logr.Discard()}
	go fake.Run(ctx)
	node := &fakeNode{c: env.client, ns: ns, app: "vm", bootDelay: 300 * time.Millisecond, running: map[types.UID]func(){}, booted: map[string]time.Time{}}
	go node.run(ctx, t)
	startController(t, env, ns)

	set := &v1alpha1.ExporterSet{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "vm"},
		Spec: v1alpha1.ExporterSetSpec{
			Replicas: ptr.To(int32(0)), MinAvailable: ptr.To(int32(0)),
			Selector:          &metav1.LabelSelector{MatchLabels: map[string]string{"app": "vm"}},
			ScaleDownCooldown: &metav1.Duration{},
			Jumpstarter:       &v1alpha1.JumpstarterSpec{ExporterLabels: map[string]string{"board": "vm"}},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "vm"}},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "vm", Image: "registry.invalid/os:1"}}},
			},
		},
	}
	require.NoError(t, env.client.Create(ctx, set))
	eventually(t, "cold exporter credentialed", func() (bool, string) {
		var e jsv1.Exporter
		err := env.client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "vm-cold"}, &e)
		return err == nil && e.Status.Credential != nil, fmt.Sprint(err)
	})

	lease := func(name string) *jsv1.Lease {
		var l jsv1.Lease
		require.NoError(t, env.client.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, &l))
		return &l
	}
	start := time.Now()
	require.NoError(t, env.client.Create(ctx, &jsv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "first"},
		Spec: jsv1.LeaseSpec{ClientRef: corev1.LocalObjectReference{Name: "ci"}, Selector: metav1.LabelSelector{MatchLabels: map[string]string{"board": "vm"}},
			Duration: &metav1.Duration{Duration: time.Hour}}}))
	var holder string
	eventually(t, "first lease lands on a booted pod's exporter", func() (bool, string) {
		l := lease("first")
		if l.Status.Ended {
			t.Fatalf("the lease ended: %v", l.Status.Conditions)
		}
		if l.Status.ExporterRef == nil {
			return false, fmt.Sprint(l.Status.Conditions)
		}
		holder = l.Status.ExporterRef.Name
		return true, ""
	})
	fromZero := time.Since(start)
	assert.NotEqual(t, "vm-cold", holder, "the cold exporter got the lease")
	c := meta.FindStatusCondition(lease("first").Status.Conditions, jsv1.LeaseConditionPending)
	require.NotNil(t, c, "the lease was never Pending")
	assert.Equal(t, "Offline", c.Reason, "the lease waited on the cold exporter")

	var pods corev1.PodList
	require.NoError(t, env.client.List(ctx, &pods, client.InNamespace(ns), client.MatchingLabels{"app": "vm"}))
	require.Len(t, pods.Items, 1)
	assert.Equal(t, holder, pods.Items[0].Name, "the lease is on the pod's Exporter")

	// Scale to 1 warm pod on top: minAvailable 1.
	// A merge patch: the controller writes the set's status meanwhile.
	require.NoError(t, env.client.Patch(ctx, set, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"minAvailable":1}}`))))
	eventually(t, "a warm exporter online", func() (bool, string) {
		var el jsv1.ExporterList
		require.NoError(t, env.client.List(ctx, &el, client.InNamespace(ns), client.MatchingLabels{v1alpha1.ExporterSetLabel: "vm"}))
		for _, e := range el.Items {
			if e.Name != holder && e.Name != "vm-cold" && meta.IsStatusConditionTrue(e.Status.Conditions, jsv1.ExporterConditionOnline) {
				return true, ""
			}
		}
		return false, fmt.Sprint(len(el.Items))
	})
	start = time.Now()
	require.NoError(t, env.client.Create(ctx, &jsv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "second"},
		Spec: jsv1.LeaseSpec{ClientRef: corev1.LocalObjectReference{Name: "ci"}, Selector: metav1.LabelSelector{MatchLabels: map[string]string{"board": "vm"}},
			Duration: &metav1.Duration{Duration: time.Hour}}}))
	eventually(t, "second lease lands on the warm exporter", func() (bool, string) {
		l := lease("second")
		return l.Status.ExporterRef != nil, fmt.Sprint(l.Status.Conditions)
	})
	warm := time.Since(start)
	t.Logf("lease -> exporterRef: from zero %s (fake boot %s), warm %s", fromZero.Round(time.Millisecond), node.bootDelay, warm.Round(time.Millisecond))

	// Release the first: Replace disables, then deletes its pod.
	l := lease("first")
	l.Spec.Release = true
	require.NoError(t, env.client.Update(ctx, l))
	eventually(t, "released pod deleted", func() (bool, string) {
		var p corev1.Pod
		err := env.client.Get(ctx, types.NamespacedName{Namespace: ns, Name: holder}, &p)
		return err != nil || p.DeletionTimestamp != nil, "still there"
	})
	var ev corev1.EventList
	require.NoError(t, env.client.List(ctx, &ev, client.InNamespace(ns)))
	var disabledFirst bool
	for _, e := range ev.Items {
		if e.Reason == controller.EventExporterDisabled {
			disabledFirst = true
		}
	}
	assert.True(t, disabledFirst, "no ExporterDisabled event before the delete")
	assert.False(t, lease("second").Status.Ended, "the second lease survived the recycle")
}
