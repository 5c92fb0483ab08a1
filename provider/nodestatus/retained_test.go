package nodestatus

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

func TestReservedWithRetained(t *testing.T) {
	reserved := corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("1"), corev1.ResourceEphemeralStorage: resource.MustParse("1Gi")}
	got := reservedWithRetained(reserved, 512<<20)
	assert.Equal(t, int64(1<<30+512<<20), ptr.To(got[corev1.ResourceEphemeralStorage]).Value())
	assert.Equal(t, "1", ptr.To(got[corev1.ResourceCPU]).String())
	assert.Equal(t, "1Gi", ptr.To(reserved[corev1.ResourceEphemeralStorage]).String(), "the configured reservation is not changed")
	assert.Equal(t, int64(4096), ptr.To(reservedWithRetained(nil, 4096)[corev1.ResourceEphemeralStorage]).Value())
	assert.Equal(t, reserved, reservedWithRetained(reserved, 0))

	// The node's allocatable shrinks by what retained disks take.
	capacity := corev1.ResourceList{corev1.ResourceEphemeralStorage: resource.MustParse("10Gi")}
	alloc := Allocatable(capacity, reservedWithRetained(reserved, 2<<30))
	assert.Equal(t, int64(7<<30), ptr.To(alloc[corev1.ResourceEphemeralStorage]).Value())
}

func TestRetainedBytes(t *testing.T) {
	dir := t.TempDir()
	n, err := RetainedBytes(dir)
	require.NoError(t, err)
	assert.Zero(t, n, "no retained/ dir")
	d := filepath.Join(dir, RetainedDirName, "ns_p_uid")
	require.NoError(t, os.MkdirAll(d, 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(d, "a"), make([]byte, 64<<10), 0o600))
	// Sparse: 1 GiB long, nothing allocated; counts what it uses.
	f, err := os.Create(filepath.Join(d, "sparse"))
	require.NoError(t, err)
	require.NoError(t, f.Truncate(1<<30))
	require.NoError(t, f.Close())
	n, err = RetainedBytes(dir)
	require.NoError(t, err)
	assert.GreaterOrEqual(t, n, int64(64<<10))
	assert.Less(t, n, int64(1<<20), "a sparse file counts its allocated blocks, not its length")
}

// TestRetainedDisksInNodeStatus: the host reading measures the retained
// disks and the node's allocatable ephemeral-storage is capacity less the
// configured reserve less them.
func TestRetainedDisksInNodeStatus(t *testing.T) {
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	d := filepath.Join(state, RetainedDirName, "ns_p_uid")
	require.NoError(t, os.MkdirAll(d, 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(d, "disk.qcow2"), make([]byte, 256<<10), 0o600))
	h, err := HostSource{StateDir: state, QEMUBinary: "sh"}.Read()
	require.NoError(t, err)
	want, err := RetainedBytes(state)
	require.NoError(t, err)
	assert.GreaterOrEqual(t, want, int64(256<<10))
	assert.Equal(t, want, h.RetainedBytes)

	cfg := resolve(t, "") // reserved ephemeral-storage 1Gi by default
	host := healthyHost()
	host.RetainedBytes = 3 * gi
	st := Status(nil, facts(cfg), host, metav1.Now())
	got := st.Allocatable[corev1.ResourceEphemeralStorage]
	assert.Equal(t, int64(96*gi), got.Value(), "100Gi - 1Gi reserved - 3Gi retained")
	assert.Equal(t, int64(100*gi), ptr.To(st.Capacity[corev1.ResourceEphemeralStorage]).Value(), "capacity is the file system")
	host.RetainedBytes = 0
	st = Status(nil, facts(cfg), host, metav1.Now())
	assert.Equal(t, int64(99*gi), ptr.To(st.Allocatable[corev1.ResourceEphemeralStorage]).Value())
}
