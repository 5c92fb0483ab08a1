package oci

import (
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"net/http/httptest"
)

// gatedRegistry proxies to a registry and holds the second layer-blob GET
// until release is closed; secondBlob is closed when that GET arrives.
type gatedRegistry struct {
	addr       string
	mu         sync.Mutex
	blobGETs   int
	secondBlob chan struct{}
	release    chan struct{}
}

func newGatedRegistry(t *testing.T, target string) *gatedRegistry {
	g := &gatedRegistry{secondBlob: make(chan struct{}), release: make(chan struct{})}
	u, err := url.Parse("http://" + target)
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(u)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/blobs/") {
			g.mu.Lock()
			g.blobGETs++
			n := g.blobGETs
			g.mu.Unlock()
			if n == 2 {
				close(g.secondBlob)
				select {
				case <-g.release:
				case <-r.Context().Done():
					return
				}
			}
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	g.addr = strings.TrimPrefix(srv.URL, "http://")
	return g
}

// TestGCDoesNotSweepBlobsOfAPullStartedAfterItsSnapshot: GC picks its
// victims under the store lock, then sweeps unreferenced blobs. A pull that
// starts in between (here: in the gcAfterSnapshot window, held on its
// second layer, so its manifests and first layer are committed blobs) must
// lose nothing to the sweep: it completes, and its entry's manifest blobs
// are still in content/.
func TestGCDoesNotSweepBlobsOfAPullStartedAfterItsSnapshot(t *testing.T) {
	ctx := testCtx(t)
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "vmlinuz"), randomBytes(t, 200<<10), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "initrd.img"), randomBytes(t, 100<<10), 0o644))
	orasPush(t, reg, "gcrace/os:1", dir, "vmlinuz", "initrd.img")
	gate := newGatedRegistry(t, reg.Addr)

	s := openStore(t, "", Options{Concurrency: 1}) // layers one after the other
	type result struct {
		img *Image
		err error
	}
	pulled := make(chan result, 1)
	gcAfterSnapshot = func() {
		go func() {
			img, err := s.Pull(ctx, gate.addr+"/gcrace/os:1", PullOptions{})
			pulled <- result{img, err}
		}()
		select {
		case <-gate.secondBlob: // manifests and the first layer are in content/
		case r := <-pulled:
			t.Errorf("pull ended before its second layer: %v", r.err)
		}
	}
	t.Cleanup(func() { gcAfterSnapshot = nil })
	_, err := s.GC(ctx, GCPolicy{MaxAge: 1})
	gcAfterSnapshot = nil
	require.NoError(t, err)
	close(gate.release)
	r := <-pulled
	require.NoError(t, r.err, "the pull lost blobs to a GC that started before it")
	require.FileExists(t, r.img.Kernel)
	require.FileExists(t, r.img.Initrd)
	for _, d := range []string{r.img.Digest, r.img.ManifestDigest} {
		_, err := s.content.Info(ctx, digest.Digest(d))
		require.NoError(t, err, "manifest blob %s of the committed entry", d)
	}
}

// TestGCTrashDirsDoNotCollide: GC moves an entry to a trash dir under tmp/
// before deleting it; that name must be unique, as another GC (or a crash,
// until the next Open) may still hold a trash dir of the same digest.
func TestGCTrashDirsDoNotCollide(t *testing.T) {
	ctx := testCtx(t)
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	pushRawDisk(t, reg, "gctrash/os:1", 64<<10)
	s := openStore(t, "", Options{})
	img, err := s.Pull(ctx, reg.Addr+"/gctrash/os:1", PullOptions{})
	require.NoError(t, err)
	// What an earlier GC of the same digest left while it still deletes.
	other := filepath.Join(s.root, "tmp", "gc-"+entryDirName(digest.Digest(img.Digest)))
	require.NoError(t, os.MkdirAll(filepath.Join(other, "busy"), 0o755))

	res, err := s.GC(ctx, GCPolicy{MaxBytes: 1})
	require.NoError(t, err)
	require.Equal(t, []string{img.Digest}, res.Removed)
	require.NoDirExists(t, s.entryDir(digest.Digest(img.Digest)))
	require.DirExists(t, filepath.Join(other, "busy"), "another GC's trash is not ours")
	var blobs int
	require.NoError(t, s.content.Walk(ctx, func(content.Info) error { blobs++; return nil }))
	require.Zero(t, blobs)
	// The digest can be cached again.
	_, err = s.Pull(ctx, reg.Addr+"/gctrash/os:1", PullOptions{})
	require.NoError(t, err)
}

// TestGCOfAStoreThatNeverPulled: the image GC of a node that never pulled
// an image (its content store has no blobs dir yet) is a no-op, with any
// policy, and does not create what a pull would; the store still pulls
// after it (covered by the pull tests) and a GC after a reopen is as quiet.
func TestGCOfAStoreThatNeverPulled(t *testing.T) {
	ctx := testCtx(t)
	root := t.TempDir()
	s := openStore(t, root, Options{})
	for _, p := range []GCPolicy{{}, {MaxBytes: 1}, {MaxAge: time.Nanosecond}, {MaxBytes: 1, MaxAge: time.Nanosecond}} {
		res, err := s.GC(ctx, p)
		require.NoError(t, err, "GC %+v of a store that never pulled", p)
		require.Empty(t, res.Removed)
		require.Zero(t, res.FreedBytes)
		require.Zero(t, res.TotalBytes)
		require.Zero(t, res.KeptInUse)
	}
	require.NoDirExists(t, filepath.Join(root, "content", "blobs"), "GC creates no blobs dir")
	require.NoError(t, s.Close())
	s = openStore(t, root, Options{})
	_, err := s.GC(ctx, GCPolicy{MaxBytes: 1, MaxAge: time.Nanosecond})
	require.NoError(t, err, "GC after a reopen")
	require.Empty(t, s.List())
}
