package exporter

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"io"
	"os"
	"syscall"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestWriteSparse: writeSparse writes exactly the image (zero pages left
// as holes, sizes not a multiple of its block), hashes every byte in
// order, and fails with the transfer's own error, the limit, an empty
// image, or the file's error, without hanging on any of them.
func TestWriteSparse(t *testing.T) {
	dir := t.TempDir()
	img := make([]byte, 5*flashBlock+12345)
	_, err := rand.Read(img[:flashBlock/2])
	require.NoError(t, err)
	copy(img[3*flashBlock-100:], bytes.Repeat([]byte{7}, flashBlock)) // across a block boundary
	img[len(img)-1] = 1                                               // the tail is data
	write := func(r io.Reader, limit int64) (*os.File, int64, []byte, error) {
		f, err := os.CreateTemp(dir, "img-")
		require.NoError(t, err)
		t.Cleanup(func() { f.Close() })
		h := sha256.New()
		n, err := writeSparse(f, r, h, limit, nil)
		return f, n, h.Sum(nil), err
	}

	f, n, sum, err := write(bytes.NewReader(img), 1<<30)
	require.NoError(t, err)
	assert.Equal(t, int64(len(img)), n)
	want := sha256.Sum256(img)
	assert.Equal(t, want[:], sum)
	got, err := os.ReadFile(f.Name())
	require.NoError(t, err)
	assert.True(t, bytes.Equal(img, got), "the file holds the image")
	fi, err := f.Stat()
	require.NoError(t, err)
	assert.Less(t, fi.Sys().(*syscall.Stat_t).Blocks*512, int64(3*flashBlock), "zero pages stay holes")

	_, _, _, err = write(bytes.NewReader(img), int64(len(img))-1)
	require.ErrorIs(t, err, jumpstarter.ErrInvalidArgument)
	assert.Contains(t, err.Error(), "larger than the partition may hold")

	stop := errors.New("the client stopped")
	_, _, _, err = write(&testutil.BrokenReader{R: bytes.NewReader(img[:3*flashBlock+5]), Err: stop}, 1<<30)
	assert.ErrorIs(t, err, stop)

	_, _, _, err = write(bytes.NewReader(nil), 1<<30)
	require.ErrorIs(t, err, jumpstarter.ErrInvalidArgument)
	assert.Contains(t, err.Error(), "empty")

	ro, err := os.CreateTemp(dir, "ro-")
	require.NoError(t, err)
	ro.Close()
	rf, err := os.Open(ro.Name()) // read-only: every write fails
	require.NoError(t, err)
	defer rf.Close()
	_, err = writeSparse(rf, bytes.NewReader(img), sha256.New(), 1<<30, nil)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "write "+ro.Name())
}
