package controller

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

func TestPendingFor(t *testing.T) {
	now := t0
	want := labels.Set{"board": "rpi4", "arch": "arm64"}
	lease := func(f func(*jsv1.Lease)) *jsv1.Lease {
		l := &jsv1.Lease{Spec: jsv1.LeaseSpec{Selector: metav1.LabelSelector{MatchLabels: map[string]string{"board": "rpi4"}}}}
		if f != nil {
			f(l)
		}
		return l
	}
	cases := []struct {
		name string
		l    *jsv1.Lease
		want bool
	}{
		{"matching, unassigned", lease(nil), true},
		{"selector on a subset of the labels", lease(func(l *jsv1.Lease) {
			l.Spec.Selector = metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "arch", Operator: metav1.LabelSelectorOpIn, Values: []string{"arm64", "amd64"}}}}
		}), true},
		{"selector needs a label the set's exporters lack", lease(func(l *jsv1.Lease) { l.Spec.Selector.MatchLabels["dut"] = "x" }), false},
		{"other board", lease(func(l *jsv1.Lease) { l.Spec.Selector.MatchLabels["board"] = "x" }), false},
		{"empty selector (Jumpstarter marks it Invalid)", lease(func(l *jsv1.Lease) { l.Spec.Selector = metav1.LabelSelector{} }), false},
		{"ended", lease(func(l *jsv1.Lease) { l.Status.Ended = true }), false},
		{"assigned", lease(func(l *jsv1.Lease) { l.Status.ExporterRef = &corev1.LocalObjectReference{Name: "e"} }), false},
		{"asks for an exporter by name", lease(func(l *jsv1.Lease) { l.Spec.ExporterRef = &corev1.LocalObjectReference{Name: "e"} }), false},
		{"released before it landed", lease(func(l *jsv1.Lease) { l.Spec.Release = true }), false},
		{"begins later", lease(func(l *jsv1.Lease) { l.Spec.BeginTime = &metav1.Time{Time: now.Add(time.Minute)} }), false},
		{"begin time reached", lease(func(l *jsv1.Lease) { l.Spec.BeginTime = &metav1.Time{Time: now} }), true},
		{"Unsatisfiable (being ended)", lease(func(l *jsv1.Lease) {
			l.Status.Conditions = []metav1.Condition{{Type: jsv1.LeaseConditionUnsatisfiable, Status: metav1.ConditionTrue, Reason: "NoAccess"}}
		}), false},
		{"being deleted", lease(func(l *jsv1.Lease) { l.DeletionTimestamp = &metav1.Time{Time: now} }), false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { assert.Equal(t, tc.want, pendingFor(tc.l, want, now)) })
	}
}

// TestEnvtestJumpstarterLeases: the lease source on a real API server.
func TestEnvtestJumpstarterLeases(t *testing.T) {
	ns := namespace(t)
	ctx := context.Background()
	set := jsSet(ns, "src", 0)
	createSet(t, set)
	for _, name := range []string{"held", "history", "free"} {
		e := newExporter(ourJS(set), &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID("u-" + name)}})
		e.OwnerReferences = nil // no such pod in this test
		require.NoError(t, env.client.Create(ctx, e))
	}
	mk := func(name string, f func(*jsv1.Lease)) {
		l := newLease(ns, name, map[string]string{"board": "src"})
		require.NoError(t, env.client.Create(ctx, l))
		if f != nil {
			updateLeaseStatus(t, ns, name, f)
		}
	}
	mk("on-held", func(l *jsv1.Lease) { l.Status.ExporterRef = &corev1.LocalObjectReference{Name: "held"} })
	mk("ended-on-history", func(l *jsv1.Lease) {
		l.Status.ExporterRef = &corev1.LocalObjectReference{Name: "history"}
		l.Status.Ended = true
	})
	mk("waiting-1", nil)
	mk("waiting-2", nil)
	// The Exporter's leaseRef seen before the Lease's assignment (the two
	// informers are not ordered): leased, not demand.
	mk("assigned-unseen", nil)
	updateExporterStatus(t, ns, "free", func(e *jsv1.Exporter) { e.Status.LeaseRef = &corev1.LocalObjectReference{Name: "assigned-unseen"} })
	mk("ended-waiting", func(l *jsv1.Lease) { l.Status.Ended = true })
	pods := []corev1.Pod{{ObjectMeta: metav1.ObjectMeta{Name: "held"}}, {ObjectMeta: metav1.ObjectMeta{Name: "history"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "free"}}, {ObjectMeta: metav1.ObjectMeta{Name: "marked", Labels: map[string]string{v1alpha1.UsedLabel: "true"}}}}
	got, demand, err := JumpstarterLeases{Reader: env.client}.Leases(ctx, set, pods)
	require.NoError(t, err)
	assert.Equal(t, int32(2), demand)
	assert.Equal(t, map[string]Lease{
		"held":    {Leased: true, Holder: "on-held", Used: true},
		"history": {Used: true}, // a lease that came and went still retires it
		"free":    {Leased: true, Holder: "assigned-unseen"},
		"marked":  {Used: true},
	}, got)

	set.Spec.RecyclePolicy = v1alpha1.RecyclePolicyReuse
	got, _, err = JumpstarterLeases{Reader: env.client}.Leases(ctx, set, pods)
	require.NoError(t, err)
	assert.Equal(t, Lease{}, got["history"], "Reuse: Jumpstarter hands a released exporter out again")
	assert.Equal(t, Lease{Leased: true, Holder: "on-held"}, got["held"])
}
