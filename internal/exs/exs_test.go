package exs

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

var now = time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)

func newSet(name string) *v1alpha1.ExporterSet {
	return &v1alpha1.ExporterSet{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "lab", UID: types.UID("uid-" + name)},
		Spec: v1alpha1.ExporterSetSpec{
			Replicas: ptr.To[int32](2),
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": name}},
		},
	}
}

// mkPod is a Ready pod of set created age ago; opts adjust it.
func mkPod(set *v1alpha1.ExporterSet, name string, age time.Duration, opts ...func(*corev1.Pod)) corev1.Pod {
	p := corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "lab", Labels: map[string]string{"app": set.Name},
			CreationTimestamp: metav1.NewTime(now.Add(-age)),
			OwnerReferences:   []metav1.OwnerReference{*metav1.NewControllerRef(set, v1alpha1.GroupVersion.WithKind("ExporterSet"))}},
		Spec: corev1.PodSpec{NodeName: "qk-1", Containers: []corev1.Container{{Name: "vm", Image: "x",
			Ports: []corev1.ContainerPort{{Name: "ssh", ContainerPort: 22}, {ContainerPort: 5353, Protocol: corev1.ProtocolUDP}}}}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.0.0.7",
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}},
	}
	for _, o := range opts {
		o(&p)
	}
	return p
}

func leasedBy(h string) func(*corev1.Pod) {
	return func(p *corev1.Pod) {
		p.Labels[v1alpha1.LeaseLabel], p.Labels[v1alpha1.UsedLabel] = h, "true"
	}
}
func annotated(k, v string) func(*corev1.Pod) {
	return func(p *corev1.Pod) {
		if p.Annotations == nil {
			p.Annotations = map[string]string{}
		}
		p.Annotations[k] = v
	}
}
func unready(p *corev1.Pod)  { p.Status.Conditions[0].Status = corev1.ConditionFalse }
func usedOnly(p *corev1.Pod) { p.Labels[v1alpha1.UsedLabel] = "true" }

func TestClassify(t *testing.T) {
	s := newSet("rpi")
	del := metav1.NewTime(now)
	for _, tc := range []struct {
		pod  corev1.Pod
		want State
	}{
		{mkPod(s, "free", time.Minute), Free},
		{mkPod(s, "leased", time.Minute, leasedBy("ci")), Leased},
		{mkPod(s, "until-later", time.Minute, leasedBy("ci"), annotated(v1alpha1.LeaseExpiresAnnotation, "2026-01-01T12:00:01Z")), Leased},
		{mkPod(s, "expired", time.Minute, leasedBy("ci"), annotated(v1alpha1.LeaseExpiresAnnotation, "2026-01-01T12:00:00Z")), Expired},
		{mkPod(s, "bad-expiry", time.Minute, leasedBy("ci"), annotated(v1alpha1.LeaseExpiresAnnotation, "soon")), Leased},
		{mkPod(s, "released", time.Minute, usedOnly), Recycling},
		{mkPod(s, "deleting", time.Minute, func(p *corev1.Pod) { p.DeletionTimestamp = &del }), Recycling},
		{mkPod(s, "booting", time.Minute, unready), Booting},
		{mkPod(s, "failed", time.Minute, unready, func(p *corev1.Pod) { p.Status.Phase = corev1.PodFailed }), Failed},
		{mkPod(s, "lease-label-only", time.Minute, func(p *corev1.Pod) { p.Labels[v1alpha1.LeaseLabel] = "x" }), Leased},
	} {
		assert.Equal(t, tc.want, Classify(&tc.pod, now), tc.pod.Name)
	}
}

func TestSetPodsAndClaimable(t *testing.T) {
	s, other := newSet("rpi"), newSet("other")
	pods := []corev1.Pod{
		mkPod(s, "young", time.Second),
		mkPod(s, "old", time.Hour),
		mkPod(other, "foreign", time.Hour), // same labels would not matter: owner decides
		mkPod(s, "leased", time.Hour, leasedBy("ci")),
		mkPod(s, "booting", time.Hour, unready),
	}
	orphan := mkPod(s, "orphan", time.Hour)
	orphan.OwnerReferences = nil
	pods = append(pods, orphan)
	got := SetPods(s, pods)
	var names []string
	for _, p := range got {
		names = append(names, p.Name)
	}
	assert.Equal(t, []string{"booting", "leased", "old", "young"}, names, "owned by the set, oldest first")
	names = nil
	for _, p := range Claimable(got, now) {
		names = append(names, p.Name)
	}
	assert.Equal(t, []string{"old", "young"}, names)
}

func TestPatches(t *testing.T) {
	var m struct {
		Metadata struct {
			ResourceVersion string             `json:"resourceVersion"`
			Labels          map[string]*string `json:"labels"`
			Annotations     map[string]*string `json:"annotations"`
		} `json:"metadata"`
	}
	require.NoError(t, json.Unmarshal(ClaimPatch("42", "ci-1", now, 20*time.Second), &m))
	assert.Equal(t, "42", m.Metadata.ResourceVersion, "the precondition")
	assert.Equal(t, "ci-1", *m.Metadata.Labels[v1alpha1.LeaseLabel])
	assert.Equal(t, "true", *m.Metadata.Labels[v1alpha1.UsedLabel])
	assert.Equal(t, "2026-01-01T12:00:20Z", *m.Metadata.Annotations[v1alpha1.LeaseExpiresAnnotation])
	assert.Equal(t, "2026-01-01T12:00:00Z", *m.Metadata.Annotations[v1alpha1.LeasedAtAnnotation])

	m.Metadata.Annotations = nil
	require.NoError(t, json.Unmarshal(ClaimPatch("43", "ci-1", now, 0), &m))
	assert.Contains(t, m.Metadata.Annotations, v1alpha1.LeaseExpiresAnnotation)
	assert.Nil(t, m.Metadata.Annotations[v1alpha1.LeaseExpiresAnnotation], "no --for removes a stale expiry")

	m.Metadata.Labels, m.Metadata.Annotations = nil, nil
	require.NoError(t, json.Unmarshal(ReleasePatch("44"), &m))
	assert.Equal(t, "44", m.Metadata.ResourceVersion)
	assert.Contains(t, m.Metadata.Labels, v1alpha1.LeaseLabel)
	assert.Nil(t, m.Metadata.Labels[v1alpha1.LeaseLabel])
	assert.NotContains(t, m.Metadata.Labels, v1alpha1.UsedLabel, "the used mark stays: the controller recycles")
	assert.Len(t, m.Metadata.Annotations, 2)
}

func TestHolder(t *testing.T) {
	assert.Equal(t, "alice.build-7", DefaultHolder("alice", "build-7.ci.example.com"))
	assert.Equal(t, "bob", DefaultHolder("bob", ""))
	assert.Equal(t, "host", DefaultHolder("", "host"))
	assert.Equal(t, "j-doe.h", DefaultHolder("j doe", "h"), "invalid characters become -")
	assert.Equal(t, "x", DefaultHolder("@@x@@", ""), "alphanumeric at both ends")
	assert.Equal(t, "", DefaultHolder("", ""))
	long := DefaultHolder(strings.Repeat("a", 100), "h")
	assert.Len(t, long, 63)
	for _, h := range []string{"alice.build-7", "bob", "j-doe.h", long} {
		assert.NoError(t, ValidateHolder(h), h)
	}
	assert.ErrorContains(t, ValidateHolder(""), "--holder")
	assert.ErrorContains(t, ValidateHolder("a b"), `holder "a b" cannot be the value of label qemu-kubelet.io/leased-by`)
	assert.ErrorContains(t, ValidateHolder(strings.Repeat("a", 64)), "63")
	assert.NoError(t, ValidateDuration(time.Second))
	assert.ErrorContains(t, ValidateDuration(500*time.Millisecond), "at least 1s")
	assert.ErrorContains(t, ValidateDuration(-time.Minute), "at least 1s")
}

func TestWriteList(t *testing.T) {
	s, js := newSet("rpi"), newSet("jsb")
	js.Spec.Jumpstarter = &v1alpha1.JumpstarterSpec{ExporterLabels: map[string]string{"board": "x"}}
	js.Status = v1alpha1.ExporterSetStatus{Replicas: 3, AvailableReplicas: 1, LeasedReplicas: 1}
	s.Spec.RecyclePolicy = v1alpha1.RecyclePolicyReuse
	sets := []SetView{
		{Set: *js},
		{Set: *s, Pods: []corev1.Pod{
			mkPod(s, "rpi-a", 10*time.Minute),
			mkPod(s, "rpi-b", 10*time.Minute, leasedBy("ci-1"), annotated(v1alpha1.LeasedAtAnnotation, "2026-01-01T11:58:00Z"),
				annotated(v1alpha1.LeaseExpiresAnnotation, "2026-01-01T12:18:00Z")),
			mkPod(s, "rpi-c", time.Minute, unready),
			mkPod(s, "rpi-d", time.Hour, leasedBy("raw")), // claimed without the plugin
		}},
	}
	var b bytes.Buffer
	require.NoError(t, WriteList(&b, sets, now))
	want := `EXPORTERSET   MODE          POLICY    PODS   FREE   LEASED   OTHER
jsb           jumpstarter   Replace   3      1      1        1
rpi           standalone    Reuse     4      1      2        1

EXPORTERSET   POD     STATE     HOLDER   LEASED   EXPIRES   NODE   AGE
rpi           rpi-a   free      -        -        -         qk-1   10m
rpi           rpi-b   leased    ci-1     2m       in 18m    qk-1   10m
rpi           rpi-c   booting   -        -        -         qk-1   60s
rpi           rpi-d   leased    raw      -        -         qk-1   60m
`
	assert.Equal(t, want, b.String())
}

func TestWriteLeased(t *testing.T) {
	s := newSet("rpi")
	p := mkPod(s, "rpi-a", time.Minute, leasedBy("ci-1"), annotated(v1alpha1.LeaseExpiresAnnotation, "2026-01-01T12:30:00Z"))
	var b bytes.Buffer
	WriteLeased(&b, &p, "rpi", "ci-1", now)
	out := b.String()
	for _, want := range []string{
		"Leased pod rpi-a of exporterset rpi as ci-1 until 2026-01-01T12:30:00Z (in 30m).",
		"node: qk-1  pod IP: 10.0.0.7",
		"kubectl -n lab logs -f rpi-a",
		"kubectl -n lab attach -it rpi-a",
		"guest port 22 (ssh):",
		"kubectl -n lab port-forward pod/rpi-a 22:22",
		"kubectl exs -n lab release rpi-a",
	} {
		assert.Contains(t, out, want)
	}
	assert.NotContains(t, out, "5353", "UDP ports cannot be port-forwarded")
}

// fakeClient is a controller-runtime fake API (objects, resourceVersion
// preconditions on patches, watches); icpt may intercept calls.
func fakeClient(t *testing.T, icpt *interceptor.Funcs, objs ...client.Object) client.WithWatch {
	t.Helper()
	scheme := runtime.NewScheme()
	require.NoError(t, errors.Join(clientgoscheme.AddToScheme(scheme), v1alpha1.AddToScheme(scheme)))
	b := fake.NewClientBuilder().WithScheme(scheme).WithObjects(objs...)
	if icpt != nil {
		b = b.WithInterceptorFuncs(*icpt)
	}
	return b.Build()
}

func objs(set *v1alpha1.ExporterSet, pods ...corev1.Pod) []client.Object {
	out := []client.Object{set}
	for i := range pods {
		out = append(out, &pods[i])
	}
	return out
}

func TestLeaseClaimsAFreePod(t *testing.T) {
	s := newSet("rpi")
	c := &Client{C: fakeClient(t, nil, objs(s, mkPod(s, "rpi-a", time.Minute, leasedBy("other")), mkPod(s, "rpi-b", time.Minute))...),
		Namespace: "lab", Now: func() time.Time { return now }}
	p, set, err := c.Lease(t.Context(), "rpi", LeaseOptions{Holder: "ci-1", For: 20 * time.Second})
	require.NoError(t, err)
	assert.Equal(t, "rpi", set.Name)
	assert.Equal(t, "rpi-b", p.Name)
	var got corev1.Pod
	require.NoError(t, c.C.Get(t.Context(), client.ObjectKey{Namespace: "lab", Name: "rpi-b"}, &got))
	assert.Equal(t, "ci-1", got.Labels[v1alpha1.LeaseLabel])
	assert.Equal(t, "true", got.Labels[v1alpha1.UsedLabel])
	assert.Equal(t, "2026-01-01T12:00:20Z", got.Annotations[v1alpha1.LeaseExpiresAnnotation])

	// Nothing free now: without --wait, a clear error with the counts.
	_, _, err = c.Lease(t.Context(), "rpi", LeaseOptions{Holder: "ci-2"})
	require.ErrorIs(t, err, ErrNoFreeTarget)
	assert.ErrorContains(t, err, "no free target in exporterset lab/rpi (2 pods: 2 leased); --wait waits for one")

	_, _, err = c.Lease(t.Context(), "nope", LeaseOptions{Holder: "ci-2"})
	assert.ErrorContains(t, err, "exporterset lab/nope not found")
	_, _, err = c.Lease(t.Context(), "rpi", LeaseOptions{Holder: "bad holder"})
	assert.ErrorContains(t, err, "cannot be the value of label")
	_, _, err = c.Lease(t.Context(), "rpi", LeaseOptions{Holder: "ci", For: time.Millisecond})
	assert.ErrorContains(t, err, "at least 1s")
}

// TestLeaseConflictRetries: a claim that loses the race (Conflict on the
// resourceVersion precondition) reads again and takes another pod.
func TestLeaseConflictRetries(t *testing.T) {
	s := newSet("rpi")
	var patched []string
	icpt := &interceptor.Funcs{Patch: func(ctx context.Context, c client.WithWatch, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
		patched = append(patched, obj.GetName())
		if len(patched) == 1 {
			// Another client claims this pod first.
			var p corev1.Pod
			if err := c.Get(ctx, client.ObjectKeyFromObject(obj), &p); err != nil {
				return err
			}
			p.Labels[v1alpha1.LeaseLabel], p.Labels[v1alpha1.UsedLabel] = "rival", "true"
			if err := c.Update(ctx, &p); err != nil {
				return err
			}
		}
		return c.Patch(ctx, obj, patch, opts...)
	}}
	c := &Client{C: fakeClient(t, icpt, objs(s, mkPod(s, "rpi-a", time.Minute), mkPod(s, "rpi-b", time.Minute))...), Namespace: "lab"}
	p, _, err := c.Lease(t.Context(), "rpi", LeaseOptions{Holder: "ci-1"})
	require.NoError(t, err)
	require.Len(t, patched, 2, "one lost claim, one won")
	assert.NotEqual(t, patched[0], p.Name, "the pod the rival took is not ours")
	var first corev1.Pod
	require.NoError(t, c.C.Get(t.Context(), client.ObjectKey{Namespace: "lab", Name: patched[0]}, &first))
	assert.Equal(t, "rival", first.Labels[v1alpha1.LeaseLabel], "the losing claim wrote nothing")
}

// TestLeaseWaits: with Wait and no free pod, Lease watches and claims the
// first pod that becomes free.
func TestLeaseWaits(t *testing.T) {
	s := newSet("rpi")
	fc := fakeClient(t, nil, objs(s, mkPod(s, "rpi-a", time.Minute, unready), mkPod(s, "rpi-b", time.Minute, leasedBy("x")))...)
	var progress bytes.Buffer
	c := &Client{C: fc, Namespace: "lab", Progress: &progress}
	type res struct {
		p   *corev1.Pod
		err error
	}
	done := make(chan res, 1)
	go func() {
		p, _, err := c.Lease(t.Context(), "rpi", LeaseOptions{Holder: "ci-1", Wait: true})
		done <- res{p, err}
	}()
	select {
	case r := <-done:
		t.Fatalf("Lease returned before a pod was free: %+v", r)
	case <-time.After(300 * time.Millisecond):
	}
	var p corev1.Pod
	require.NoError(t, fc.Get(t.Context(), client.ObjectKey{Namespace: "lab", Name: "rpi-a"}, &p))
	p.Status.Conditions[0].Status = corev1.ConditionTrue
	require.NoError(t, fc.Status().Update(t.Context(), &p))
	select {
	case r := <-done:
		require.NoError(t, r.err)
		assert.Equal(t, "rpi-a", r.p.Name)
	case <-time.After(10 * time.Second):
		t.Fatal("Lease did not claim the pod that became Ready")
	}
	assert.Contains(t, progress.String(), "Waiting for a free target of exporterset lab/rpi (2 pods: 1 leased, 1 booting)")

	// A bounded wait gives up with the cause.
	ctx, cancel := context.WithTimeoutCause(t.Context(), 200*time.Millisecond, errors.New("--timeout 200ms reached"))
	defer cancel()
	_, _, err := c.Lease(ctx, "rpi", LeaseOptions{Holder: "ci-2", Wait: true})
	assert.ErrorContains(t, err, "gave up waiting for a free target of exporterset lab/rpi: --timeout 200ms reached")
}

func TestJumpstarterModeRefused(t *testing.T) {
	s := newSet("jsb")
	s.Spec.Jumpstarter = &v1alpha1.JumpstarterSpec{ExporterLabels: map[string]string{"board": "rpi4", "lab": "a"}}
	c := &Client{C: fakeClient(t, nil, objs(s, mkPod(s, "jsb-a", time.Minute, leasedBy("x")))...), Namespace: "lab"}
	_, _, err := c.Lease(t.Context(), "jsb", LeaseOptions{Holder: "ci"})
	require.ErrorIs(t, err, ErrJumpstarterMode)
	assert.ErrorContains(t, err, "use jmp, e.g. `jmp create lease -l board=rpi4,lab=a`")
	_, _, _, err = c.Release(t.Context(), "jsb-a", ReleaseOptions{Force: true})
	assert.ErrorIs(t, err, ErrJumpstarterMode)
	var p corev1.Pod
	require.NoError(t, c.C.Get(t.Context(), client.ObjectKey{Namespace: "lab", Name: "jsb-a"}, &p))
	assert.Equal(t, "x", p.Labels[v1alpha1.LeaseLabel], "nothing written")
}

func TestRelease(t *testing.T) {
	s := newSet("rpi")
	stranger := mkPod(s, "stranger", time.Minute)
	stranger.OwnerReferences = nil
	c := &Client{C: fakeClient(t, nil, objs(s,
		mkPod(s, "mine", time.Minute, leasedBy("ci-1"), annotated(v1alpha1.LeaseExpiresAnnotation, "2026-01-01T12:30:00Z"),
			annotated(v1alpha1.LeasedAtAnnotation, "2026-01-01T12:00:00Z")),
		mkPod(s, "theirs", time.Minute, leasedBy("ci-2")),
		mkPod(s, "free", time.Minute), stranger)...), Namespace: "lab"}
	ctx := t.Context()

	p, holder, set, err := c.Release(ctx, "pod/mine", ReleaseOptions{Holder: "ci-1"})
	require.NoError(t, err)
	assert.Equal(t, "ci-1", holder)
	assert.Equal(t, "rpi", set.Name)
	var got corev1.Pod
	require.NoError(t, c.C.Get(ctx, client.ObjectKey{Namespace: "lab", Name: p.Name}, &got))
	assert.NotContains(t, got.Labels, v1alpha1.LeaseLabel)
	assert.Equal(t, "true", got.Labels[v1alpha1.UsedLabel], "the used mark stays for the controller")
	assert.Empty(t, got.Annotations)

	_, _, _, err = c.Release(ctx, "theirs", ReleaseOptions{Holder: "ci-1"})
	require.ErrorIs(t, err, ErrNotHolder)
	assert.ErrorContains(t, err, `pod lab/theirs is leased by "ci-2", not by "ci-1"; --holder ci-2 or --force releases it`)
	require.NoError(t, c.C.Get(ctx, client.ObjectKey{Namespace: "lab", Name: "theirs"}, &got))
	assert.Equal(t, "ci-2", got.Labels[v1alpha1.LeaseLabel], "not released")
	_, _, _, err = c.Release(ctx, "theirs", ReleaseOptions{Holder: "ci-1", Force: true})
	require.NoError(t, err)

	_, _, _, err = c.Release(ctx, "free", ReleaseOptions{})
	assert.ErrorContains(t, err, "pod lab/free is not leased (state free)")
	_, _, _, err = c.Release(ctx, "stranger", ReleaseOptions{})
	assert.ErrorContains(t, err, "pod lab/stranger is not a pod of an ExporterSet")
	_, _, _, err = c.Release(ctx, "ghost", ReleaseOptions{})
	assert.ErrorContains(t, err, "pod lab/ghost not found")
}

func TestList(t *testing.T) {
	a, b := newSet("a"), newSet("b")
	c := &Client{C: fakeClient(t, nil, b, a, &[]corev1.Pod{mkPod(a, "a-1", time.Minute)}[0]), Namespace: "lab"}
	sets, err := c.List(t.Context(), "")
	require.NoError(t, err)
	require.Len(t, sets, 2)
	assert.Equal(t, "a", sets[0].Set.Name, "sorted by name")
	assert.Len(t, sets[0].Pods, 1)
	assert.Empty(t, sets[1].Pods)
	_, err = c.List(t.Context(), "zzz")
	assert.ErrorContains(t, err, "exporterset lab/zzz not found")
}
