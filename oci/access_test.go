package oci

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
)

// TestPullProveAccess: with ProveAccess, a digest in the cache is served
// only to a pull the registry hands the manifest to (credentials it
// accepts), from the cache; a registry that names the cached digest for
// its own tag without holding the manifest gets an error, where a pull
// without ProveAccess would have been served the cached image.
func TestPullProveAccess(t *testing.T) {
	ctx := testCtx(t)
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{User: "alice", Pass: "s3cret"})
	dir := t.TempDir()
	disk := randomBytes(t, 128<<10)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "disk.raw"), disk, 0o644))
	orasPush(t, reg, "private/os:1", dir, "disk.raw")
	ref := reg.Addr + "/private/os:1"
	s := openStore(t, "", Options{})
	cached, err := s.Pull(ctx, ref, PullOptions{Auth: [][]byte{dockerConfigJSON(reg.Addr, "alice", "s3cret")}})
	require.NoError(t, err)
	byDigest := reg.Addr + "/private/os@" + cached.Digest

	for _, r := range []string{ref, byDigest} {
		_, err := s.Pull(ctx, r, PullOptions{Policy: PullAlways, ProveAccess: true})
		require.ErrorIs(t, err, ErrUnauthorized, r)
	}
	img, err := s.Pull(ctx, byDigest, PullOptions{Policy: PullAlways, ProveAccess: true, Credentials: &Credentials{Username: "alice", Password: "s3cret"}})
	require.NoError(t, err)
	assert.Equal(t, cached.Digest, img.Digest)
	assert.Equal(t, disk, fileBytes(t, img.Disk))

	var manifestGETs atomic.Int32
	liar := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.Contains(r.URL.Path, "/manifests/") {
			return
		}
		body := `{"schemaVersion":2}`
		w.Header().Set("Content-Type", ocispec.MediaTypeImageManifest)
		w.Header().Set("Docker-Content-Digest", cached.Digest)
		w.Header().Set("Content-Length", fmt.Sprint(len(body)))
		if r.Method == http.MethodGet {
			manifestGETs.Add(1)
			_, _ = w.Write([]byte(body))
		}
	}))
	defer liar.Close()
	liarRef := strings.TrimPrefix(liar.URL, "http://") + "/evil/os:1"
	_, err = s.Pull(ctx, liarRef, PullOptions{Policy: PullAlways, ProveAccess: true})
	require.ErrorIs(t, err, ErrDigestMismatch)
	assert.Contains(t, err.Error(), "nothing is served from the node's cache")
	assert.Equal(t, int32(1), manifestGETs.Load(), "the manifest was asked for by digest")
	img, err = s.Pull(ctx, liarRef, PullOptions{Policy: PullAlways})
	require.NoError(t, err, "without ProveAccess the claim alone is served from the cache")
	assert.Equal(t, cached.Digest, img.Digest)
}

// refusingDialer refuses every address, counting the attempts.
type refusingDialer struct{ n atomic.Int32 }

var errRefused = errors.New("refused by the test's dial policy")

func (d *refusingDialer) DialContext(_ context.Context, _, addr string) (net.Conn, error) {
	d.n.Add(1)
	return nil, fmt.Errorf("dial %s: %w", addr, errRefused)
}

// TestPullDial: a pull with its own Dialer makes every connection
// through it (the node's shared connections are not reused for it).
func TestPullDial(t *testing.T) {
	ctx := testCtx(t)
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "disk.raw"), randomBytes(t, 64<<10), 0o644))
	orasPush(t, reg, "os:1", dir, "disk.raw")
	s := openStore(t, "", Options{})
	_, err := s.Pull(ctx, reg.Addr+"/os:1", PullOptions{}) // the node's connection, kept alive
	require.NoError(t, err)
	d := &refusingDialer{}
	_, err = s.Pull(ctx, reg.Addr+"/os:1", PullOptions{Policy: PullAlways, Dial: d})
	require.Error(t, err)
	assert.Contains(t, err.Error(), errRefused.Error())
	assert.Positive(t, d.n.Load(), "the pull dialled through its Dialer")
	img, err := s.Pull(ctx, reg.Addr+"/os:1", PullOptions{Policy: PullAlways, Dial: &net.Dialer{}})
	require.NoError(t, err, "a Dialer that connects")
	assert.NotEmpty(t, img.Disk)
}
