package controller

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

const testEndpoint, testCA = "jumpstarter.example:8082", "-----BEGIN CERTIFICATE-----\ntest\n-----END CERTIFICATE-----\n"

// jsSet is a Jumpstarter-mode set whose exporters carry board=<name>.
func jsSet(ns, name string, replicas int32, mutate ...func(*v1alpha1.ExporterSet)) *v1alpha1.ExporterSet {
	return sampleSet(ns, name, replicas, append([]func(*v1alpha1.ExporterSet){func(s *v1alpha1.ExporterSet) {
		s.Spec.Jumpstarter = &v1alpha1.JumpstarterSpec{Endpoint: testEndpoint, CABundle: testCA, ExporterLabels: map[string]string{"board": name}}
	}}, mutate...)...)
}

// startJSManager runs the controller with the given drain delay (and
// options changed by opts).
func startJSManager(t *testing.T, ns string, drain time.Duration, opts ...func(*ctrl.Options)) *Reconciler {
	t.Helper()
	o := ctrl.Options{
		Scheme:                 env.scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Cache:                  cache.Options{DefaultNamespaces: map[string]cache.Config{ns: {}}},
		Controller:             ctrlConfigUnique(),
	}
	for _, f := range opts {
		f(&o)
	}
	mgr, err := ctrl.NewManager(env.cfg, o)
	require.NoError(t, err)
	m, err := NewMetrics(prometheus.NewRegistry())
	require.NoError(t, err)
	r := NewReconciler(mgr.GetClient(), mgr.GetEventRecorder("exporterset-controller"), m)
	r.DrainDelay = drain
	require.NoError(t, r.SetupWithManager(mgr, 2))
	require.True(t, r.Jumpstarter, "Jumpstarter mode not detected although its CRDs are installed")
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
	return r
}

// --- Jumpstarter's side, played by the test ---

func newLease(ns, name string, sel map[string]string) *jsv1.Lease {
	return &jsv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: jsv1.LeaseSpec{ClientRef: corev1.LocalObjectReference{Name: "ci"}, Selector: metav1.LabelSelector{MatchLabels: sel},
			Duration: &metav1.Duration{Duration: time.Hour}},
	}
}

func createLease(t *testing.T, ns, name string, sel map[string]string) {
	t.Helper()
	require.NoError(t, env.client.Create(context.Background(), newLease(ns, name, sel)))
}

func getExporter(t *testing.T, ns, name string) (*jsv1.Exporter, error) {
	t.Helper()
	var e jsv1.Exporter
	err := env.client.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, &e)
	return &e, err
}

// issueCredential does what Jumpstarter's exporter controller does for a
// new Exporter: a <name>-exporter Secret with key token, status.credential
// and status.endpoint.
func issueCredential(t *testing.T, ns, name string) {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, env.client.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name + "-exporter"},
		Data: map[string][]byte{"token": []byte("tok-" + name)}}))
	updateExporterStatus(t, ns, name, func(e *jsv1.Exporter) {
		e.Status.Credential = &corev1.LocalObjectReference{Name: name + "-exporter"}
		e.Status.Endpoint = "jumpstarter-own.example:8082"
	})
}

func updateExporterStatus(t *testing.T, ns, name string, f func(*jsv1.Exporter)) {
	t.Helper()
	eventually(t, "status update of exporter "+name, func() (bool, string) {
		e, err := getExporter(t, ns, name)
		if err != nil {
			return false, err.Error()
		}
		f(e)
		if err := env.client.Status().Update(context.Background(), e); err != nil {
			return false, err.Error()
		}
		return true, ""
	})
}

func updateLeaseStatus(t *testing.T, ns, name string, f func(*jsv1.Lease)) {
	t.Helper()
	eventually(t, "status update of lease "+name, func() (bool, string) {
		var l jsv1.Lease
		if err := env.client.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, &l); err != nil {
			return false, err.Error()
		}
		f(&l)
		if err := env.client.Status().Update(context.Background(), &l); err != nil {
			return false, err.Error()
		}
		return true, ""
	})
}

// assignLease lands a lease on an exporter as Jumpstarter does: the Lease's
// exporterRef and Ready first, the Exporter's leaseRef after.
func assignLease(t *testing.T, ns, lease, exporter string) {
	t.Helper()
	updateLeaseStatus(t, ns, lease, func(l *jsv1.Lease) {
		l.Status.ExporterRef = &corev1.LocalObjectReference{Name: exporter}
		l.Status.BeginTime = &metav1.Time{Time: time.Now()}
		meta.SetStatusCondition(&l.Status.Conditions, metav1.Condition{Type: jsv1.LeaseConditionReady, Status: metav1.ConditionTrue, Reason: "Ready", Message: "acquired"})
	})
	updateExporterStatus(t, ns, exporter, func(e *jsv1.Exporter) { e.Status.LeaseRef = &corev1.LocalObjectReference{Name: lease} })
}

// endLease ends a lease as Jumpstarter does on release.
func endLease(t *testing.T, ns, lease, exporter string) {
	t.Helper()
	updateLeaseStatus(t, ns, lease, func(l *jsv1.Lease) {
		l.Status.Ended = true
		l.Status.EndTime = &metav1.Time{Time: time.Now()}
	})
	updateExporterStatus(t, ns, exporter, func(e *jsv1.Exporter) { e.Status.LeaseRef = nil })
}

func exporterSecret(t *testing.T, ns, pod string) (*corev1.Secret, error) {
	var s corev1.Secret
	err := env.client.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: exporterSecretName(pod)}, &s)
	return &s, err
}

// credentialAll issues the credential of each pod's Exporter and waits for
// the gates to go.
func credentialAll(t *testing.T, ns string, ps []corev1.Pod) {
	t.Helper()
	for _, p := range ps {
		eventually(t, "exporter of "+p.Name, func() (bool, string) {
			_, err := getExporter(t, ns, p.Name)
			return err == nil, fmt.Sprint(err)
		})
		issueCredential(t, ns, p.Name)
	}
	for _, p := range ps {
		eventually(t, "gate removed from "+p.Name, func() (bool, string) {
			q := getPod(t, &p)
			return !hasGate(q), fmt.Sprint(q.Spec.SchedulingGates)
		})
	}
}

func eventsOf(t *testing.T, ns, reason string) []string {
	t.Helper()
	var l corev1.EventList
	require.NoError(t, env.client.List(context.Background(), &l, client.InNamespace(ns)))
	var out []string
	for _, e := range l.Items {
		if e.Reason == reason {
			out = append(out, e.Message)
		}
	}
	return out
}

// everSeen records every pod UID of an app seen until the test ends.
func everSeen(t *testing.T, ns, app string) func() map[types.UID]string {
	t.Helper()
	seen := map[types.UID]string{}
	stop := make(chan struct{})
	done := make(chan struct{})
	poll := func() {
		var l corev1.PodList
		if err := env.client.List(context.Background(), &l, client.InNamespace(ns), client.MatchingLabels{"app": app}); err == nil {
			for _, p := range l.Items {
				seen[p.UID] = p.Name
			}
		}
	}
	go func() {
		defer close(done)
		for {
			poll()
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	var stopped bool
	return func() map[types.UID]string {
		if !stopped {
			close(stop)
			<-done
			stopped = true
		}
		poll()
		return seen
	}
}

// TestEnvtestJumpstarterFromZero: replicas 0, minAvailable 0; a cold
// exporter keeps a lease waiting; the lease makes exactly one gated pod with
// its Exporter; the credential releases the gate with the exporter Secret
// written; the lease lands (LEASED 1); on release the Exporter is disabled
// before the pod and Exporter go, and nothing replaces them.
func TestEnvtestJumpstarterFromZero(t *testing.T) {
	ns := namespace(t)
	startJSManager(t, ns, 300*time.Millisecond)
	createSet(t, jsSet(ns, "zero", 0, func(s *v1alpha1.ExporterSet) { s.Spec.MinAvailable = ptr.To(int32(0)) }))
	seen := everSeen(t, ns, "zero")

	// The cold exporter: enabled, the set's labels, owned by the set, no pod.
	eventually(t, "cold exporter", func() (bool, string) {
		e, err := getExporter(t, ns, "zero-cold")
		if err != nil {
			return false, err.Error()
		}
		return e.IsEnabled() && e.Labels["board"] == "zero" && e.Labels[v1alpha1.ExporterPodLabel] == v1alpha1.ExporterPodCold &&
			metav1.GetControllerOf(e) != nil && metav1.GetControllerOf(e).Kind == "ExporterSet", fmt.Sprint(e.Labels)
	})
	assert.Empty(t, pods(t, ns, "zero"))

	createLease(t, ns, "lease-a", map[string]string{"board": "zero"})
	createLease(t, ns, "other-board", map[string]string{"board": "else"}) // not ours: no demand
	ps := waitPodCount(t, ns, "zero", 1)
	p := ps[0]
	assert.True(t, hasGate(&p), "pod created without the scheduling gate")
	assert.Equal(t, exporterSecretName(p.Name), p.Annotations[v1alpha1.JumpstarterSecretAnnotation])
	// The Secret is referenced by a volume, so the Node authorizer lets the
	// pod's node read it.
	var vol *corev1.Volume
	for i := range p.Spec.Volumes {
		if p.Spec.Volumes[i].Name == v1alpha1.JumpstarterSecretVolume {
			vol = &p.Spec.Volumes[i]
		}
	}
	if assert.NotNil(t, vol, "volume %s", v1alpha1.JumpstarterSecretVolume) && assert.NotNil(t, vol.Secret) {
		assert.Equal(t, exporterSecretName(p.Name), vol.Secret.SecretName)
	}
	var e *jsv1.Exporter
	eventually(t, "the pod's Exporter", func() (bool, string) {
		var err error
		e, err = getExporter(t, ns, p.Name)
		return err == nil, fmt.Sprint(err)
	})
	assert.True(t, e.IsEnabled())
	assert.Equal(t, "zero", e.Labels["board"])
	assert.Equal(t, p.UID, metav1.GetControllerOf(e).UID, "the pod's Exporter is owned by the pod")
	st := waitStatus(t, ns, "zero", "pending 1, gated", func(s v1alpha1.ExporterSetStatus) bool {
		c := condition(s, v1alpha1.ConditionExportersReady)
		return s.PendingLeases == 1 && s.DesiredReplicas == 1 && c != nil && c.Status == metav1.ConditionFalse
	})
	assert.Contains(t, condition(st.Status, v1alpha1.ConditionExportersReady).Message, "has no status.credential yet")
	eventually(t, "LeaseDemand event", func() (bool, string) {
		ev := eventsOf(t, ns, EventLeaseDemand)
		return len(ev) > 0 && strings.Contains(ev[0], "lease-a"), fmt.Sprint(ev)
	})
	_, err := exporterSecret(t, ns, p.Name)
	assert.True(t, apierrors.IsNotFound(err), "exporter Secret written before the credential: %v", err)

	issueCredential(t, ns, p.Name)
	eventually(t, "gate removed", func() (bool, string) {
		q := getPod(t, &p)
		return !hasGate(q), fmt.Sprint(q.Spec.SchedulingGates)
	})
	sec, err := exporterSecret(t, ns, p.Name)
	require.NoError(t, err)
	assert.Len(t, sec.Data[v1alpha1.JumpstarterSecretPassword], 32, "the default guest login's generated password")
	assert.Equal(t, map[string]string{"endpoint": testEndpoint, "token": "tok-" + p.Name, "namespace": ns, "name": p.Name, "ca.crt": testCA,
		"username": v1alpha1.GeneratedGuestLoginUser},
		func() map[string]string {
			m := map[string]string{}
			for k, v := range sec.Data {
				if k != v1alpha1.JumpstarterSecretPassword {
					m[k] = string(v)
				}
			}
			return m
		}())
	assert.Equal(t, p.UID, metav1.GetControllerOf(sec).UID, "the Secret is owned by the pod")
	waitStatus(t, ns, "zero", "exporters ready", func(s v1alpha1.ExporterSetStatus) bool {
		c := condition(s, v1alpha1.ConditionExportersReady)
		return c != nil && c.Status == metav1.ConditionTrue
	})

	setReady(t, &p)
	assignLease(t, ns, "lease-a", p.Name)
	waitStatus(t, ns, "zero", "leased 1, pending 0", func(s v1alpha1.ExporterSetStatus) bool {
		return s.LeasedReplicas == 1 && s.PendingLeases == 0 && s.DesiredReplicas == 1
	})
	time.Sleep(time.Second)
	assert.Len(t, pods(t, ns, "zero"), 1, "the lease landing created another pod")

	// Release: Replace disables the Exporter first, then the pod goes.
	endLease(t, ns, "lease-a", p.Name)
	eventually(t, "exporter disabled while its pod still exists", func() (bool, string) {
		e, err := getExporter(t, ns, p.Name)
		if err != nil {
			return false, err.Error()
		}
		return !e.IsEnabled(), "enabled"
	})
	// The pod is deleted only after the disable (it may already be going).
	q := &corev1.Pod{}
	err = env.client.Get(context.Background(), client.ObjectKeyFromObject(&p), q)
	assert.True(t, err == nil || apierrors.IsNotFound(err))
	waitPodCount(t, ns, "zero", 0)
	eventually(t, "pod's exporter deleted", func() (bool, string) {
		_, err := getExporter(t, ns, p.Name)
		return apierrors.IsNotFound(err), fmt.Sprint(err)
	})
	time.Sleep(time.Second)
	assert.Empty(t, pods(t, ns, "zero"), "replicas 0 and no demand: nothing replaces the released pod")
	all := seen()
	assert.Len(t, all, 1, "pods ever created: %v", all)
	e, err = getExporter(t, ns, "zero-cold")
	require.NoError(t, err, "the cold exporter stays")
	assert.True(t, e.IsEnabled())
}

// TestEnvtestJumpstarterBurstOnePass: 10 pending leases waiting when the
// controller starts make 10 pods in one pass, and never more.
func TestEnvtestJumpstarterBurstOnePass(t *testing.T) {
	ns := namespace(t)
	createSet(t, jsSet(ns, "burst", 0, func(s *v1alpha1.ExporterSet) { s.Spec.MaxReplicas = ptr.To(int32(20)) }))
	for i := range 10 {
		createLease(t, ns, fmt.Sprintf("l%02d", i), map[string]string{"board": "burst"})
	}
	seen := everSeen(t, ns, "burst")
	startJSManager(t, ns, 300*time.Millisecond)
	ps := waitPodCount(t, ns, "burst", 10)
	eventually(t, "one LeaseDemand event for all 10", func() (bool, string) {
		ev := eventsOf(t, ns, EventLeaseDemand)
		return len(ev) == 1 && strings.HasPrefix(ev[0], "Creating 10 pods for 10 pending leases: l00, l01"), fmt.Sprint(ev)
	})
	waitStatus(t, ns, "burst", "pending 10", func(s v1alpha1.ExporterSetStatus) bool { return s.PendingLeases == 10 && s.Replicas == 10 })
	// The leases land one by one: the target stays 10, nothing more is made.
	credentialAll(t, ns, ps)
	for i, p := range ps {
		assignLease(t, ns, fmt.Sprintf("l%02d", i), p.Name)
	}
	waitStatus(t, ns, "burst", "leased 10", func(s v1alpha1.ExporterSetStatus) bool { return s.LeasedReplicas == 10 && s.PendingLeases == 0 })
	time.Sleep(time.Second)
	all := seen()
	assert.Len(t, all, 10, "pods ever created (no double-create): %v", all)
}

// TestEnvtestJumpstarterScaleDownSparesLeased: scale-down disables and then
// deletes unleased pods; the leased pod's Exporter is never disabled.
func TestEnvtestJumpstarterScaleDownSparesLeased(t *testing.T) {
	ns := namespace(t)
	startJSManager(t, ns, 300*time.Millisecond)
	createSet(t, jsSet(ns, "down", 3))
	ps := waitPodCount(t, ns, "down", 3)
	credentialAll(t, ns, ps)
	readyAll(t, ps)
	createLease(t, ns, "held", map[string]string{"board": "down"})
	assignLease(t, ns, "held", ps[1].Name)
	waitStatus(t, ns, "down", "leased 1", func(s v1alpha1.ExporterSetStatus) bool { return s.LeasedReplicas == 1 })

	// Watch the Exporters: the leased one must never be disabled; the others
	// must be seen disabled while their pod still exists.
	type seenState struct{ leasedDisabled, drained map[string]bool }
	obs := make(chan seenState, 1)
	stop := make(chan struct{})
	go func() {
		s := seenState{map[string]bool{}, map[string]bool{}}
		defer func() { obs <- s }()
		for {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			for i, p := range ps {
				e, err := getExporter(t, ns, p.Name)
				if err != nil || e.IsEnabled() {
					continue
				}
				if i == 1 {
					s.leasedDisabled[p.Name] = true
				} else if err := env.client.Get(context.Background(), client.ObjectKeyFromObject(&p), &corev1.Pod{}); err == nil {
					s.drained[p.Name] = true
				}
			}
		}
	}()

	mustKubectl(t, "-n", ns, "scale", "exs/down", "--replicas=0")
	left := waitPodCount(t, ns, "down", 1)
	assert.Equal(t, ps[1].Name, left[0].Name, "the leased pod stays")
	for _, p := range []corev1.Pod{ps[0], ps[2]} {
		eventually(t, "exporter of scaled-down pod deleted", func() (bool, string) {
			_, err := getExporter(t, ns, p.Name)
			return apierrors.IsNotFound(err), fmt.Sprint(err)
		})
	}
	close(stop)
	s := <-obs
	assert.Empty(t, s.leasedDisabled, "the leased pod's Exporter was disabled")
	assert.Equal(t, map[string]bool{ps[0].Name: true, ps[2].Name: true}, s.drained, "Exporters seen disabled while their pod existed")
	assert.NotEmpty(t, eventsOf(t, ns, EventExporterDisabled))
	e, err := getExporter(t, ns, ps[1].Name)
	require.NoError(t, err)
	assert.True(t, e.IsEnabled())
	assert.Empty(t, e.Annotations[v1alpha1.ExporterDisabledAtAnnotation])
}

// TestEnvtestJumpstarterLeaseDuringDrainKeepsPod: a lease that lands on an
// Exporter after it was disabled keeps the pod; the pod goes after release.
func TestEnvtestJumpstarterLeaseDuringDrainKeepsPod(t *testing.T) {
	ns := namespace(t)
	startJSManager(t, ns, 3*time.Second)
	createSet(t, jsSet(ns, "race", 1))
	ps := waitPodCount(t, ns, "race", 1)
	p := ps[0]
	credentialAll(t, ns, ps)
	setReady(t, &p)
	mustKubectl(t, "-n", ns, "scale", "exs/race", "--replicas=0")
	eventually(t, "exporter disabled", func() (bool, string) {
		e, err := getExporter(t, ns, p.Name)
		return err == nil && !e.IsEnabled(), fmt.Sprint(err)
	})
	// A lease chosen by Jumpstarter from a read made before the disable.
	createLease(t, ns, "late", map[string]string{"board": "race"})
	assignLease(t, ns, "late", p.Name)
	time.Sleep(4 * time.Second) // past the drain delay
	require.Len(t, pods(t, ns, "race"), 1, "the pod of a lease that slipped in was deleted")
	waitStatus(t, ns, "race", "leased 1", func(s v1alpha1.ExporterSetStatus) bool { return s.LeasedReplicas == 1 })
	// (The lease, pending before it landed, was demand: the Exporter may
	// have been enabled again. Either way the pod stayed.)

	endLease(t, ns, "late", p.Name)
	waitPodCount(t, ns, "race", 0)
}

// hidingReader is a stale cache: it shows Exporters without leaseRef and
// no assigned Leases, as before a lease landed.
type hidingReader struct{ client.Client }

func (h hidingReader) List(ctx context.Context, list client.ObjectList, opts ...client.ListOption) error {
	if err := h.Client.List(ctx, list, opts...); err != nil {
		return err
	}
	switch l := list.(type) {
	case *jsv1.ExporterList:
		for i := range l.Items {
			l.Items[i].Status.LeaseRef = nil
		}
	case *jsv1.LeaseList:
		kept := l.Items[:0]
		for _, x := range l.Items {
			if x.Status.ExporterRef == nil {
				kept = append(kept, x)
			}
		}
		l.Items = kept
	}
	return nil
}

// TestEnvtestJumpstarterUncachedCheckKeepsLeasedPod: the planner, on a
// cache that has not seen the lease, decides to delete a drained pod; the
// executor's read from the API server finds the lease and keeps it.
func TestEnvtestJumpstarterUncachedCheckKeepsLeasedPod(t *testing.T) {
	ns := namespace(t)
	createSet(t, jsSet(ns, "stale", 1))
	rec := countingRecorder{reasons: make(chan string, 100)}
	r := NewReconciler(env.client, rec, nil)
	r.Jumpstarter, r.DrainDelay, r.APIReader = true, time.Millisecond, env.client
	reconcileOnce(t, r, ns, "stale")
	ps := waitPodCount(t, ns, "stale", 1)
	p := ps[0]
	issueCredential(t, ns, p.Name)
	reconcileOnce(t, r, ns, "stale")
	require.False(t, hasGate(getPod(t, &p)))
	setReady(t, &p)

	set := getSet(t, ns, "stale")
	set.Spec.Replicas = ptr.To(int32(0))
	require.NoError(t, env.client.Update(context.Background(), set))
	reconcileOnce(t, r, ns, "stale") // disables
	e, err := getExporter(t, ns, p.Name)
	require.NoError(t, err)
	require.False(t, e.IsEnabled())

	createLease(t, ns, "sneaky", map[string]string{"board": "stale"})
	assignLease(t, ns, "sneaky", p.Name)
	r.Reader = hidingReader{env.client} // the plan does not see the lease
	time.Sleep(10 * time.Millisecond)
	reconcileOnce(t, r, ns, "stale")
	assert.Len(t, pods(t, ns, "stale"), 1, "the leased pod was deleted")
	_, err = getExporter(t, ns, p.Name)
	assert.NoError(t, err, "the leased pod's Exporter was deleted")
	var reasons []string
	for len(rec.reasons) > 0 {
		reasons = append(reasons, <-rec.reasons)
	}
	assert.Contains(t, reasons, EventLeaseKeptPod)
	assert.NotContains(t, reasons, EventSuccessfulDelete)
}

// TestEnvtestJumpstarterUnavailable: without Jumpstarter mode the set says
// why and creates nothing.
func TestEnvtestJumpstarterUnavailable(t *testing.T) {
	ns := namespace(t)
	createSet(t, jsSet(ns, "nojs", 2))
	r := NewReconciler(env.client, countingRecorder{reasons: make(chan string, 100)}, nil)
	reconcileOnce(t, r, ns, "nojs")
	assert.Empty(t, pods(t, ns, "nojs"))
	c := condition(getSet(t, ns, "nojs").Status, v1alpha1.ConditionReplicaFailure)
	require.NotNil(t, c)
	assert.Equal(t, "JumpstarterUnavailable", c.Reason)
}

// TestEnvtestJumpstarterGuestLogin: a set naming a guest login Secret keeps
// its pods gated until that Secret exists, then writes its username and
// password into each pod's exporter Secret (the node seeds them into the
// guest and answers get_username/get_password with them).
func TestEnvtestJumpstarterGuestLogin(t *testing.T) {
	ns := namespace(t)
	startJSManager(t, ns, 300*time.Millisecond)
	createSet(t, jsSet(ns, "login", 1, func(s *v1alpha1.ExporterSet) {
		s.Spec.MinAvailable = ptr.To(int32(0))
		s.Spec.Jumpstarter.GuestLoginSecretName = "guest-login"
	}))
	p := waitPodCount(t, ns, "login", 1)[0]
	eventually(t, "the pod's Exporter", func() (bool, string) {
		_, err := getExporter(t, ns, p.Name)
		return err == nil, fmt.Sprint(err)
	})
	issueCredential(t, ns, p.Name)
	st := waitStatus(t, ns, "login", "gated for the login Secret", func(s v1alpha1.ExporterSetStatus) bool {
		c := condition(s, v1alpha1.ConditionExportersReady)
		return c != nil && strings.Contains(c.Message, "guest login Secret guest-login (spec.jumpstarter.guestLoginSecretName) not found")
	})
	assert.Equal(t, metav1.ConditionFalse, condition(st.Status, v1alpha1.ConditionExportersReady).Status)
	assert.True(t, hasGate(getPod(t, &p)), "the pod stays gated without its login")

	require.NoError(t, env.client.Create(context.Background(), &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "guest-login"},
		Data: map[string][]byte{"username": []byte("ci"), "password": []byte("Pa55-login")}}))
	eventually(t, "gate removed", func() (bool, string) {
		q := getPod(t, &p)
		return !hasGate(q), fmt.Sprint(q.Spec.SchedulingGates)
	})
	sec, err := exporterSecret(t, ns, p.Name)
	require.NoError(t, err)
	assert.Equal(t, "ci", string(sec.Data[v1alpha1.JumpstarterSecretUsername]))
	assert.Equal(t, "Pa55-login", string(sec.Data[v1alpha1.JumpstarterSecretPassword]))
	assert.Equal(t, "tok-"+p.Name, string(sec.Data[v1alpha1.JumpstarterSecretToken]))
	var evs corev1.EventList
	require.NoError(t, env.client.List(context.Background(), &evs, client.InNamespace(ns)))
	require.NotEmpty(t, evs.Items)
	for _, ev := range evs.Items {
		assert.NotContains(t, ev.Message, "Pa55-login", "the password is in no event")
	}
}

// TestEnvtestJumpstarterDefaultGuestLogin: a set that names no login gets
// one generated per pod (user jumpstarter, a random password) in the
// pod's exporter Secret, which the pod owns; the password is in no log
// line of the controller (every level captured) and no event; a set with
// defaultGuestLogin None gets none. Their pods report the default ssh
// child and the display (no annotations); a set with sshDriver and
// vncDriver Disabled puts the annotations that switch them off on its
// pods.
func TestEnvtestJumpstarterDefaultGuestLogin(t *testing.T) {
	ns := namespace(t)
	var logs syncLog
	startJSManager(t, ns, 300*time.Millisecond, func(o *ctrl.Options) {
		o.Logger = funcr.New(logs.add, funcr.Options{Verbosity: 10})
	})
	createSet(t, jsSet(ns, "deflogin", 2, func(s *v1alpha1.ExporterSet) { s.Spec.MinAvailable = ptr.To(int32(0)) }))
	ps := waitPodCount(t, ns, "deflogin", 2)
	credentialAll(t, ns, ps)
	var passwords []string
	for _, p := range ps {
		sec, err := exporterSecret(t, ns, p.Name)
		require.NoError(t, err)
		assert.Equal(t, v1alpha1.GeneratedGuestLoginUser, string(sec.Data[v1alpha1.JumpstarterSecretUsername]))
		pass := string(sec.Data[v1alpha1.JumpstarterSecretPassword])
		require.Len(t, pass, 32, "pod %s: a generated password", p.Name)
		assert.NotContains(t, passwords, pass, "one login per pod")
		passwords = append(passwords, pass)
		q := getPod(t, &p)
		assert.True(t, metav1.IsControlledBy(sec, q), "the pod owns its login Secret: %v", sec.OwnerReferences)
		assert.NotContains(t, q.Annotations, v1alpha1.SSHDriverAnnotation, "the default ssh child: no annotation")
		assert.NotContains(t, q.Annotations, v1alpha1.DisplayAnnotation, "the default display and vnc child: no annotation")
	}

	createSet(t, jsSet(ns, "nologin", 1, func(s *v1alpha1.ExporterSet) {
		s.Spec.MinAvailable = ptr.To(int32(0))
		s.Spec.Jumpstarter.DefaultGuestLogin = v1alpha1.DefaultGuestLoginNone
		s.Spec.Jumpstarter.SSHDriver = v1alpha1.DriverDisabled
		s.Spec.Jumpstarter.VNCDriver = v1alpha1.DriverDisabled
	}))
	none := waitPodCount(t, ns, "nologin", 1)
	assert.Equal(t, "Disabled", none[0].Annotations[v1alpha1.SSHDriverAnnotation], "sshDriver Disabled reaches the pod")
	assert.Equal(t, "none", none[0].Annotations[v1alpha1.DisplayAnnotation], "vncDriver Disabled reaches the pod: no display")
	credentialAll(t, ns, none)
	sec, err := exporterSecret(t, ns, none[0].Name)
	require.NoError(t, err)
	assert.NotContains(t, sec.Data, v1alpha1.JumpstarterSecretUsername, "defaultGuestLogin None: no login")
	assert.NotContains(t, sec.Data, v1alpha1.JumpstarterSecretPassword)

	require.NotEmpty(t, logs.String(), "the controller's log was captured")
	assert.Contains(t, logs.String(), "exporter secret written", "the log covers the Secret's writes")
	var evs corev1.EventList
	require.NoError(t, env.client.List(context.Background(), &evs, client.InNamespace(ns)))
	for _, pass := range passwords {
		assert.NotContains(t, logs.String(), pass, "the password is in no log line")
		for _, ev := range evs.Items {
			assert.NotContains(t, ev.Message, pass, "the password is in no event")
		}
	}
}

// syncLog collects funcr's lines from the manager's goroutines.
type syncLog struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *syncLog) add(prefix, args string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b.WriteString(prefix + " " + args + "\n")
}

func (l *syncLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
