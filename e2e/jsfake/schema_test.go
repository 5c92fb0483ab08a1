package jsfake

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// TestSchemaKeepsEveryField: the tests' Jumpstarter CRDs (generated from
// api/jumpstarter/v1alpha1) accept and keep every field the project
// writes, and refuse what upstream's schema refuses.
func TestSchemaKeepsEveryField(t *testing.T) {
	testutil.SkipIfShort(t, "a control plane")
	schemaKeepsEveryField(t, &env)
}

// TestUpstreamSchemaAcceptsTheProjectsObjects runs, against an apiserver
// with upstream Jumpstarter's own CRDs (testutil.UpstreamJumpstarterCRDs:
// $QK_JUMPSTARTER_CRDS; skipped on a clone of the repository alone), what
// the other tests run against the generated ones: every field the project
// writes kept, the fake's status writes and the tests' Leases
// (TestFakeFollowsUpstreamLeaseRules), and the ExporterSet controller
// creating, patching and deleting Exporters from zero to a recycled pod
// (TestExporterSetFromZeroThroughJumpstarter).
func TestUpstreamSchemaAcceptsTheProjectsObjects(t *testing.T) {
	testutil.SkipIfShort(t, "a control plane")
	root := testutil.MustRepoRoot(t)
	dir, ok, err := testutil.UpstreamJumpstarterCRDs(root)
	require.NoError(t, err)
	if !ok {
		t.Skip("upstream Jumpstarter CRDs not beside the repository ($QK_JUMPSTARTER_CRDS unset, none beside the repository)")
	}
	up, stop, err := startAPI(dir, filepath.Join(root, "config", "crd"))
	require.NoError(t, err)
	t.Cleanup(stop)
	t.Run("KeepsEveryField", func(t *testing.T) { schemaKeepsEveryField(t, up) })
	t.Run("FakeFollowsUpstreamLeaseRules", func(t *testing.T) { fakeFollowsUpstreamLeaseRules(t, up) })
	t.Run("ExporterSetFromZeroThroughJumpstarter", func(t *testing.T) { exporterSetFromZeroThroughJumpstarter(t, up) })
}

// schemaKeepsEveryField writes an Exporter and a Lease with every field of
// the project's types set (status through the status subresource, as
// Jumpstarter's controller and the fake do), reads them back unchanged,
// writes every exporter status the protocol has, merge-patches
// spec.enabled as the controller does, and sees invalid objects refused.
func schemaKeepsEveryField(t *testing.T, e *apiEnv) {
	ctx := context.Background()
	c := e.client
	ns := e.namespace(t)
	now := metav1.NewTime(time.Now().Truncate(time.Second).Local()) // as the API server's answer decodes
	later := metav1.NewTime(now.Add(time.Hour))
	cond := func(typ string) []metav1.Condition {
		return []metav1.Condition{{Type: typ, Status: metav1.ConditionTrue, Reason: "Seen", Message: "m", ObservedGeneration: 1, LastTransitionTime: now}}
	}

	exp := &jsv1.Exporter{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "e", Labels: map[string]string{"board": "x"}},
		Spec: jsv1.ExporterSpec{Username: new("u"), Enabled: new(false)}}
	require.NoError(t, c.Create(ctx, exp))
	exp.Status = jsv1.ExporterStatus{Conditions: cond(jsv1.ExporterConditionOnline), Credential: &corev1.LocalObjectReference{Name: "e-exporter"},
		LeaseRef: &corev1.LocalObjectReference{Name: "l"}, LastSeen: now, Endpoint: "js.example:8082", ExporterStatusValue: "LeaseReady", StatusMessage: "ready"}
	want := exp.DeepCopy()
	require.NoError(t, c.Status().Update(ctx, exp))
	var got jsv1.Exporter
	require.NoError(t, c.Get(ctx, types.NamespacedName{Namespace: ns, Name: "e"}, &got))
	assert.Equal(t, want.Spec, got.Spec, "exporter spec kept")
	assert.Equal(t, want.Status, got.Status, "exporter status kept")

	for v := range pb.ExporterStatus_name {
		name := exporterStatusName(pb.ExporterStatus(v))
		require.NoError(t, c.Get(ctx, types.NamespacedName{Namespace: ns, Name: "e"}, &got))
		got.Status.ExporterStatusValue = name
		assert.NoError(t, c.Status().Update(ctx, &got), "exporter status %s (the fake writes every status of the protocol)", name)
	}
	require.NoError(t, c.Get(ctx, types.NamespacedName{Namespace: ns, Name: "e"}, &got))
	got.Status.ExporterStatusValue = "Sleeping"
	assert.True(t, apierrors.IsInvalid(c.Status().Update(ctx, &got)), "an exporter status outside upstream's enum is refused")

	require.NoError(t, c.Patch(ctx, &jsv1.Exporter{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "e"}},
		client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"annotations":{"a":"b"}},"spec":{"enabled":true}}`))))
	require.NoError(t, c.Get(ctx, types.NamespacedName{Namespace: ns, Name: "e"}, &got))
	assert.True(t, got.IsEnabled(), "merge patch of spec.enabled")
	assert.Equal(t, "u", *got.Spec.Username, "the patch keeps the rest of spec")

	bare := &jsv1.Exporter{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "bare"}}
	require.NoError(t, c.Create(ctx, bare))
	require.NotNil(t, bare.Spec.Enabled, "spec.enabled defaulted")
	assert.True(t, *bare.Spec.Enabled, "spec.enabled defaults to true")

	lease := &jsv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "l"},
		Spec: jsv1.LeaseSpec{ClientRef: corev1.LocalObjectReference{Name: "ci"},
			Selector: metav1.LabelSelector{MatchLabels: map[string]string{"board": "x"},
				MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "rack", Operator: metav1.LabelSelectorOpIn, Values: []string{"1", "2"}}}},
			ExporterRef: &corev1.LocalObjectReference{Name: "e"}, Duration: &metav1.Duration{Duration: time.Hour},
			BeginTime: &now, EndTime: &later, Release: true}}
	require.NoError(t, c.Create(ctx, lease))
	lease.Status = jsv1.LeaseStatus{BeginTime: &now, EndTime: &later, ExporterRef: &corev1.LocalObjectReference{Name: "e"}, Ended: true,
		Conditions: cond(jsv1.LeaseConditionReady)}
	wantL := lease.DeepCopy()
	require.NoError(t, c.Status().Update(ctx, lease))
	var gotL jsv1.Lease
	require.NoError(t, c.Get(ctx, types.NamespacedName{Namespace: ns, Name: "l"}, &gotL))
	assert.Equal(t, wantL.Spec, gotL.Spec, "lease spec kept")
	assert.Equal(t, wantL.Status, gotL.Status, "lease status kept")

	noTarget := &jsv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "none"}, Spec: jsv1.LeaseSpec{ClientRef: corev1.LocalObjectReference{Name: "ci"}}}
	err := c.Create(ctx, noTarget)
	assert.True(t, apierrors.IsInvalid(err), "a lease with neither selector nor exporterRef is refused: %v", err)
	assert.ErrorContains(t, err, "one of selector or exporterRef.name is required")
}
