package nodestatus

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
)

// TestImageGCOfANodeThatNeverPulled: the image GC of a node whose image
// store never pulled anything succeeds and records no event (before, it
// failed on the content store's missing blobs dir and warned
// ImageGCFailed every period).
func TestImageGCOfANodeThatNeverPulled(t *testing.T) {
	store, err := oci.Open(t.TempDir(), oci.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = store.Close() })
	var events []string
	gc := ImageGC{Store: store, Policy: oci.GCPolicy{MaxBytes: 1, MaxAge: time.Minute}, Period: time.Minute,
		Event: func(typ, reason, msg string) { events = append(events, typ+" "+reason+": "+msg) }}
	res, err := gc.Once(context.Background())
	require.NoError(t, err)
	assert.Empty(t, res.Removed)
	assert.Empty(t, events, "no event for an empty cache")
}
