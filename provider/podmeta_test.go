package provider

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/utils/ptr"
)

// TestDeletePodTakesCurrentLabels: a label changed just before the pod's
// deletion (an ExporterSet lease released, then the pod deleted) reaches
// the provider only through DeletePod: the library calls UpdatePod only
// for pods not being deleted. The terminal status the provider pushes
// carries the pod's metadata, and the API server's NodeRestriction refuses
// a status update whose labels differ ("node cannot update labels through
// pod status"), so a stale copy loses the terminal status. Found by the
// chaos soak (e2e TestSoak).
func TestDeletePodTakesCurrentLabels(t *testing.T) {
	p, recs := pumpVMs(t, 1, record.NewFakeRecorder(100))
	rec := recs[0]
	rec.pod.Labels = map[string]string{"app": "a", "qemu-kubelet.io/leased-by": "me"}
	rec.pod.Annotations = map[string]string{"qemu-kubelet.io/leased-at": "2026-01-02T15:04:05Z"}

	current := rec.pod.DeepCopy()
	current.Labels = map[string]string{"app": "a", "qemu-kubelet.io/used": "true"}
	current.Annotations = nil
	current.DeletionTimestamp = &metav1.Time{Time: time.Now().Add(10 * time.Second)}
	current.DeletionGracePeriodSeconds = ptr.To[int64](10)
	require.NoError(t, p.DeletePod(context.Background(), current))

	got := p.withStatus(rec)
	assert.Equal(t, current.Labels, got.Labels, "the pushed status carries the labels the pod has now")
	assert.Empty(t, got.Annotations, "and its annotations")
	assert.NotNil(t, got.DeletionTimestamp)

	// A pod of the same name but another UID (a new incarnation) does not
	// overwrite the record's metadata.
	other := current.DeepCopy()
	other.UID = "other"
	other.Labels = map[string]string{"app": "b"}
	require.NoError(t, p.DeletePod(context.Background(), other))
	assert.Equal(t, current.Labels, p.withStatus(rec).Labels)
}

// TestUpdatePodPushesNewLabels: a label that changed while the agent was
// down reaches a recovered pod through UpdatePod; the provider must push a
// status carrying it, or the library keeps sending the last pushed copy
// with the stale labels, which NodeRestriction refuses until the pod's
// status changes for another reason. Found by the chaos soak.
func TestUpdatePodPushesNewLabels(t *testing.T) {
	p, recs := pumpVMs(t, 1, record.NewFakeRecorder(100))
	rec := recs[0]
	rec.pod.Labels = map[string]string{"app": "a"}
	got := make(chan *corev1.Pod, 10)
	p.NotifyPods(context.Background(), func(pod *corev1.Pod) { got <- pod })
	select {
	case pod := <-got:
		require.Equal(t, map[string]string{"app": "a"}, pod.Labels)
	case <-time.After(5 * time.Second):
		t.Fatal("initial status not delivered")
	}

	current := rec.pod.DeepCopy()
	current.Labels = map[string]string{"app": "a", "qemu-kubelet.io/leased-by": "me"}
	require.NoError(t, p.UpdatePod(context.Background(), current))
	select {
	case pod := <-got:
		assert.Equal(t, current.Labels, pod.Labels, "the pushed status carries the new labels")
	case <-time.After(5 * time.Second):
		t.Fatal("no status pushed after the labels changed")
	}
}
