package controller

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/uuid"
	"k8s.io/utils/ptr"
)

// createOrphanExporter creates the Exporter this controller makes for a
// pod of set that does not exist (what the garbage collector, absent in
// envtest, would delete).
func createOrphanExporter(t *testing.T, set jsTarget, pod string) {
	t.Helper()
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: set.Obj.GetNamespace(), Name: pod, UID: uuid.NewUUID()}}
	require.NoError(t, env.client.Create(context.Background(), newExporter(set, p)))
}

func exporterGone(t *testing.T, ns, name string) func() (bool, string) {
	return func() (bool, string) {
		_, err := getExporter(t, ns, name)
		return apierrors.IsNotFound(err), fmt.Sprint(err)
	}
}

// standaloneJS is a Reconciler in Jumpstarter mode outside a manager,
// reading through reader (nil: the API server), with a 1 ms drain delay.
func standaloneJS(reader *laggingReader) *Reconciler {
	r := NewReconciler(env.client, countingRecorder{reasons: make(chan string, 100)}, nil)
	r.Jumpstarter, r.DrainDelay, r.APIReader = true, time.Millisecond, env.client
	if reader != nil {
		r.Reader = reader
	}
	return r
}

// TestEnvtestJumpstarterStalePodCacheLeavesNoExporter: a pass whose pod
// cache still shows a pod the controller deleted does not make its
// Exporter again; a restarted controller (no expectations) on such a cache
// does, and deletes it once the cache shows the pod gone.
func TestEnvtestJumpstarterStalePodCacheLeavesNoExporter(t *testing.T) {
	ns := namespace(t)
	createSet(t, jsSet(ns, "lag", 1))
	r := standaloneJS(nil)
	reconcileOnce(t, r, ns, "lag")
	p := waitPodCount(t, ns, "lag", 1)[0]
	stale := &laggingReader{Client: env.client}
	stale.sync(t, ns) // shows p from now on

	set := getSet(t, ns, "lag")
	set.Spec.Replicas = ptr.To(int32(0))
	require.NoError(t, env.client.Update(context.Background(), set))
	reconcileOnce(t, r, ns, "lag") // disables
	time.Sleep(10 * time.Millisecond)
	reconcileOnce(t, r, ns, "lag") // deletes the pod and its Exporter
	require.Empty(t, pods(t, ns, "lag"), "scaled to 0")
	ok, state := exporterGone(t, ns, p.Name)()
	require.True(t, ok, "exporter deleted with its pod: %s", state)

	r.Reader = stale
	reconcileOnce(t, r, ns, "lag")
	ok, state = exporterGone(t, ns, p.Name)()
	assert.True(t, ok, "a pass on a cache still showing the deleted pod made its Exporter again: %s", state)

	restarted := standaloneJS(stale)
	reconcileOnce(t, restarted, ns, "lag")
	_, err := getExporter(t, ns, p.Name)
	require.NoError(t, err, "the injected lag: a restarted controller makes the Exporter of the pod its cache shows")
	restarted.Reader = nil // the cache shows the pod gone
	reconcileOnce(t, restarted, ns, "lag")
	ok, state = exporterGone(t, ns, p.Name)()
	assert.True(t, ok, "the Exporter of the gone pod was not deleted: %s", state)
}

// TestEnvtestJumpstarterOrphanExporters: an Exporter of the set whose pod
// is gone is deleted, paused or not; the Exporter of a pod the cache has
// not shown yet (read from the API server before the delete) and an
// Exporter of another set stay.
func TestEnvtestJumpstarterOrphanExporters(t *testing.T) {
	ns := namespace(t)
	createSet(t, jsSet(ns, "orph", 1))
	hidden := &laggingReader{Client: env.client}
	hidden.sync(t, ns) // no pods yet
	r := standaloneJS(nil)
	reconcileOnce(t, r, ns, "orph")
	p := waitPodCount(t, ns, "orph", 1)[0]
	set := getSet(t, ns, "orph")
	set.Spec.Paused = true
	require.NoError(t, env.client.Update(context.Background(), set))
	createOrphanExporter(t, ourJS(set), "orph-gone1")
	createOrphanExporter(t, ourJS(jsSet(ns, "other", 1)), "other-gone1")

	restarted := standaloneJS(hidden) // knows nothing of p, and its cache does not show it
	reconcileOnce(t, restarted, ns, "orph")
	ok, state := exporterGone(t, ns, "orph-gone1")()
	assert.True(t, ok, "the orphan of a paused set was not deleted: %s", state)
	_, err := getExporter(t, ns, p.Name)
	assert.NoError(t, err, "the Exporter of a pod the cache has not shown yet was deleted")
	_, err = getExporter(t, ns, "other-gone1")
	assert.NoError(t, err, "another set's Exporter was deleted")
	assert.Len(t, pods(t, ns, "orph"), 1, "a paused set created or deleted pods")
}

// TestEnvtestJumpstarterOrphanSweptByManager: with the manager's caches,
// an orphan Exporter of a running set is deleted (its creation plans the
// set); the set's own pod's Exporter stays.
func TestEnvtestJumpstarterOrphanSweptByManager(t *testing.T) {
	ns := namespace(t)
	startJSManager(t, ns, 300*time.Millisecond)
	createSet(t, jsSet(ns, "swept", 1))
	p := waitPodCount(t, ns, "swept", 1)[0]
	eventually(t, "the pod's Exporter", func() (bool, string) {
		_, err := getExporter(t, ns, p.Name)
		return err == nil, fmt.Sprint(err)
	})
	createOrphanExporter(t, ourJS(getSet(t, ns, "swept")), "swept-gone1")
	eventually(t, "orphan Exporter deleted", exporterGone(t, ns, "swept-gone1"))
	e, err := getExporter(t, ns, p.Name)
	require.NoError(t, err, "the pod's own Exporter was deleted")
	assert.Equal(t, p.UID, metav1.GetControllerOf(e).UID)
}
