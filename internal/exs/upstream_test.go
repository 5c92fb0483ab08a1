package exs

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	vt "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
)

// TestUpstreamSetsAreNotOurs: in a cluster that also serves upstream
// Jumpstarter's ExporterSet (same kind name, group
// virtualtarget.jumpstarter.dev), an upstream set of the same name and its
// pod, labelled like ours and older (the pod a claim would pick first),
// are neither listed, leased nor released: kubectl exs names
// qemu-kubelet.io sets and their pods only.
func TestUpstreamSetsAreNotOurs(t *testing.T) {
	ours := newSet("rpi")
	theirs := &vt.ExporterSet{
		ObjectMeta: metav1.ObjectMeta{Name: "rpi", Namespace: "lab", UID: types.UID("uid-upstream-rpi")},
		Spec: vt.ExporterSetSpec{VirtualTargetClassName: "vm",
			Selector: metav1.LabelSelector{MatchLabels: map[string]string{"app": "rpi"}}},
	}
	upstreamPod := mkPod(ours, "rpi-upstream", time.Hour, leasedBy("ci-9"), func(p *corev1.Pod) {
		p.OwnerReferences = []metav1.OwnerReference{*metav1.NewControllerRef(theirs, vt.GroupVersion.WithKind("ExporterSet"))}
	})
	ourPod := mkPod(ours, "rpi-a", time.Minute)
	scheme := runtime.NewScheme()
	require.NoError(t, errors.Join(clientgoscheme.AddToScheme(scheme), v1alpha1.AddToScheme(scheme), vt.AddToScheme(scheme)))
	c := &Client{C: fake.NewClientBuilder().WithScheme(scheme).WithObjects(ours, theirs, &upstreamPod, &ourPod).Build(),
		Namespace: "lab", Now: func() time.Time { return now }}

	sets, err := c.List(t.Context(), "")
	require.NoError(t, err)
	require.Len(t, sets, 1, "one qemu-kubelet.io set; the upstream set of the same name is not listed")
	assert.Equal(t, ours.UID, sets[0].Set.UID)
	require.Len(t, sets[0].Pods, 1)
	assert.Equal(t, "rpi-a", sets[0].Pods[0].Name)

	p, _, err := c.Lease(t.Context(), "rpi", LeaseOptions{Holder: "ci-1"})
	require.NoError(t, err)
	assert.Equal(t, "rpi-a", p.Name)
	var got corev1.Pod
	require.NoError(t, c.C.Get(t.Context(), client.ObjectKeyFromObject(&upstreamPod), &got))
	assert.Equal(t, "ci-9", got.Labels[v1alpha1.LeaseLabel], "the upstream set's pod keeps its labels")

	_, _, _, err = c.Release(t.Context(), "rpi-upstream", ReleaseOptions{Force: true})
	assert.ErrorContains(t, err, "pod lab/rpi-upstream is not a pod of an ExporterSet")
	require.NoError(t, c.C.Get(t.Context(), client.ObjectKeyFromObject(&upstreamPod), &got))
	assert.Equal(t, "ci-9", got.Labels[v1alpha1.LeaseLabel], "release refused: the upstream pod keeps its lease label")
}
