package provider

import (
	"context"
	"encoding/json"
	"fmt"
	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"maps"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/utils/ptr"
)

// TestHoldReadsPodWhileDeleteWritesIt: a pod held for a disabled feature
// re-reads its pod on every reload, outside the record's lock, while
// DeletePod takes the pod's current labels and annotations. A pod read
// under the lock must never change after: the race detector sees the
// write only when it falls between the hold's unlock and its read, so the
// test also holds the pod the hold read and checks it did not change.
func TestHoldReadsPodWhileDeleteWritesIt(t *testing.T) {
	p, recs := pumpVMs(t, 1, record.NewFakeRecorder(1000))
	p.cfg.Features = nil
	p.features.Store(podtest.FeaturesWith(config.FeatureJumpstarterExporter))
	rec := recs[0]
	rec.pod.Annotations = map[string]string{v1alpha1.JumpstarterSecretAnnotation: "exp"}
	rec.state = podstatus.VMState{}

	held := make(chan bool, 1)
	go func() { held <- p.runOf(rec.uid).holdForFeatures(context.Background()) }()
	// Reloads that keep the feature off: the held pod reads its pod again
	// each time, outside the record's lock.
	for range 5 {
		time.Sleep(20 * time.Millisecond)
		p.SetFeatures(podtest.FeaturesWith(config.FeatureJumpstarterExporter, config.FeatureAttach))
	}
	time.Sleep(50 * time.Millisecond)

	rec.mu.Lock()
	read := rec.pod // as the hold reads it
	rec.mu.Unlock()
	readAnnotations := maps.Clone(read.Annotations)

	current := rec.pod.DeepCopy()
	current.Annotations = map[string]string{v1alpha1.JumpstarterSecretAnnotation: "exp", "new": "1"}
	current.DeletionTimestamp = &metav1.Time{Time: time.Now().Add(30 * time.Second)}
	current.DeletionGracePeriodSeconds = ptr.To[int64](30)
	require.NoError(t, p.DeletePod(context.Background(), current))
	select {
	case ok := <-held:
		assert.False(t, ok, "a pod deleted while held does not start")
	case <-time.After(10 * time.Second):
		t.Fatal("the held pod did not see its delete")
	}
	assert.Equal(t, "1", p.withStatus(rec).Annotations["new"], "the delete's annotations are the record's")
	assert.Equal(t, readAnnotations, read.Annotations, "the pod read under the lock was changed in place")
	assert.Nil(t, read.DeletionTimestamp, "the pod read under the lock was changed in place")
}

// TestFlashRecordOrderedWithStatusWrites: a flash records the new image in
// status.json while other owners (the exporter supervisor, the status
// resync) write the pod's state: the writes are serialized, none fails on
// another's temporary file, and the file ends as the newest state.
func TestFlashRecordOrderedWithStatusWrites(t *testing.T) {
	p, recs := pumpVMs(t, 1, record.NewFakeRecorder(100000))
	rec := recs[0]
	require.NoError(t, os.MkdirAll(rec.dir, 0o700))

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var persistErrs []error
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := rec.persist(); err != nil {
				persistErrs = append(persistErrs, err)
			}
		}
	}()
	const flashes = 100
	for i := range flashes {
		img := &oci.Image{Ref: fmt.Sprintf("reg/img:v%d", i), Digest: fmt.Sprintf("sha256:%064d", i)}
		require.NoError(t, p.runOf(rec.uid).installFlash(&exporter.Flash{Image: img}), "flash %d", i)
	}
	close(stop)
	wg.Wait()
	assert.Empty(t, persistErrs, "status writes beside the flash's")

	b, err := os.ReadFile(filepath.Join(rec.dir, StatusFileName))
	require.NoError(t, err)
	var st podstatus.VMState
	require.NoError(t, json.Unmarshal(b, &st))
	assert.Equal(t, fmt.Sprintf("sha256:%064d", flashes-1), st.ImageDigest, "status.json holds the last flash")
}
