package oci

import (
	"archive/tar"

	"encoding/json"
	"github.com/containerd/containerd/v2/core/content"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
)

// pushRawDisk pushes one random raw disk with oras and returns its bytes and
// layer digest.
func pushRawDisk(t *testing.T, reg *ocitest.Registry, ref string, size int) ([]byte, digest.Digest) {
	t.Helper()
	dir := t.TempDir()
	disk := randomBytes(t, size)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "disk.raw"), disk, 0o644))
	orasPush(t, reg, ref, dir, "disk.raw")
	return disk, digest.FromBytes(disk)
}

func TestConcurrentPullsDownloadOnce(t *testing.T) {
	ctx := testCtx(t)
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	disk, layer := pushRawDisk(t, reg, "shared/os:1", 8<<20)
	proxy := ocitest.NewProxy(t, reg.Addr)
	ref := proxy.Addr + "/shared/os:1"

	// The same image under a second tag and by digest shares the download.
	ocitest.Run(ctx, t, "", ocitest.Oras(t), "tag", "--plain-http", reg.Addr+"/shared/os:1", "2")
	desc := ocitest.Run(ctx, t, "", ocitest.Oras(t), "resolve", "--plain-http", reg.Addr+"/shared/os:1")
	refs := []string{ref, proxy.Addr + "/shared/os:2", proxy.Addr + "/shared/os@" + strings.TrimSpace(desc)}

	s := openStore(t, "", Options{})
	const n = 9
	imgs := make([]*Image, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			imgs[i], errs[i] = s.Pull(ctx, refs[i%len(refs)], PullOptions{Policy: PullAlways})
		}()
	}
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i])
		require.Equal(t, imgs[0].Disk, imgs[i].Disk)
	}
	require.Equal(t, disk, fileBytes(t, imgs[0].Disk))
	require.Equal(t, 1, proxy.BlobGETs(layer.String()), "the disk blob must be downloaded once")
	list := s.List()
	require.Len(t, list, 1)
	require.Subset(t, list[0].Names, refs)
}

func TestInterruptedPullResumes(t *testing.T) {
	const size = 4 << 20
	const cut = 1 << 20
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	disk, layer := pushRawDisk(t, reg, "resume/os:1", size)

	t.Run("reconnect within one pull", func(t *testing.T) {
		ctx := testCtx(t)
		proxy := ocitest.NewProxy(t, reg.Addr)
		proxy.AddFault(&ocitest.Fault{Match: layer.String(), CutAfter: cut})
		s := openStore(t, "", Options{})
		img, err := s.Pull(ctx, proxy.Addr+"/resume/os:1", PullOptions{})
		require.NoError(t, err)
		require.Equal(t, disk, fileBytes(t, img.Disk))
		assertResumed(t, proxy, layer, size)
	})

	t.Run("failed pull resumes after store restart", func(t *testing.T) {
		ctx := testCtx(t)
		proxy := ocitest.NewProxy(t, reg.Addr)
		proxy.AddFault(&ocitest.Fault{Match: layer.String(), CutAfter: cut, FailAfterCut: 1000})
		root := t.TempDir()
		s, err := Open(root, Options{})
		require.NoError(t, err)
		_, err = s.Pull(ctx, proxy.Addr+"/resume/os:1", PullOptions{})
		t.Logf("first attempt: %v", err)
		require.ErrorIs(t, err, ErrRegistryUnavailable)
		require.Empty(t, s.List())
		sts, err := s.content.ListStatuses(ctx)
		require.NoError(t, err)
		require.Len(t, sts, 1, "the partial download is kept for resumption")
		require.Equal(t, int64(cut), sts[0].Offset)
		require.NoError(t, s.Close())

		proxy.ClearFaults()
		proxy.Reset()
		s = openStore(t, root, Options{})
		var last Progress
		img, err := s.Pull(ctx, proxy.Addr+"/resume/os:1", PullOptions{Progress: func(p Progress) { last = p }})
		require.NoError(t, err)
		require.Equal(t, disk, fileBytes(t, img.Disk))
		assertResumed(t, proxy, layer, size)
		require.Equal(t, last.Total, last.Done)
		sts, err = s.content.ListStatuses(ctx)
		require.NoError(t, err)
		require.Empty(t, sts)
	})
}

// assertResumed checks that the blob's last GET asked for a range starting at
// a non-zero offset and moved fewer bytes than the blob.
func assertResumed(t *testing.T, proxy *ocitest.Proxy, layer digest.Digest, size int64) {
	t.Helper()
	var gets []ocitest.Request
	for _, r := range proxy.Requests() {
		if r.Method == "GET" && strings.HasSuffix(r.Path, "/blobs/"+layer.String()) {
			gets = append(gets, r)
		}
	}
	require.NotEmpty(t, gets)
	last := gets[len(gets)-1]
	t.Logf("blob GETs: %+v", gets)
	require.True(t, strings.HasPrefix(last.Range, "bytes="), "resumed GET must carry a Range header, got %q", last.Range)
	from, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimPrefix(last.Range, "bytes="), "-"), 10, 64)
	require.NoError(t, err)
	require.Positive(t, from)
	require.Less(t, last.Bytes, size)
	require.Equal(t, size-from, last.Bytes)
}

func TestCorruptedBlobRejected(t *testing.T) {
	ctx := testCtx(t)
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	disk, layer := pushRawDisk(t, reg, "corrupt/os:1", 1<<20)
	blob := reg.BlobPath(layer.String())
	bad := append([]byte(nil), disk...)
	bad[len(bad)/2] ^= 0xff
	require.NoError(t, os.WriteFile(blob, bad, 0o644))

	s := openStore(t, "", Options{})
	_, err := s.Pull(ctx, reg.Addr+"/corrupt/os:1", PullOptions{})
	t.Logf("error: %v", err)
	require.ErrorIs(t, err, ErrDigestMismatch)
	assertNothingCached(t, s, layer)
	sts, err := s.content.ListStatuses(ctx)
	require.NoError(t, err)
	require.Empty(t, sts, "a corrupt partial download must not be kept for resumption")

	// Once the registry serves the right bytes, the same store pulls fine.
	require.NoError(t, os.WriteFile(blob, disk, 0o644))
	img, err := s.Pull(ctx, reg.Addr+"/corrupt/os:1", PullOptions{})
	require.NoError(t, err)
	require.Equal(t, disk, fileBytes(t, img.Disk))
}

func TestHostileContainerDiskRejected(t *testing.T) {
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	s := openStore(t, "", Options{})
	ok := ocitest.TarEntry{Name: "disk/d.raw", Body: []byte("disk")}
	backing := func() []byte {
		dir := t.TempDir()
		p := filepath.Join(dir, "b.qcow2")
		ocitest.Run(testCtx(t), t, dir, "qemu-img", "create", "-q", "-f", "qcow2", "-b", "/etc/passwd", "-F", "raw", p, "1M")
		return fileBytes(t, p)
	}
	for i, tc := range []struct {
		name    string
		entries []ocitest.TarEntry
		msg     string
	}{
		{"absolute path", []ocitest.TarEntry{ok, {Name: "/etc/cron.d/x", Body: []byte("x")}}, "absolute path"},
		{"dot-dot", []ocitest.TarEntry{{Name: "disk/../../escape", Body: []byte("x")}, ok}, `".."`},
		{"symlink escaping", []ocitest.TarEntry{{Name: "disk/link", Type: tar.TypeSymlink, Linkname: "../../etc/shadow"}, ok}, "escapes"},
		{"absolute symlink", []ocitest.TarEntry{{Name: "x", Type: tar.TypeSymlink, Linkname: "/etc/shadow"}, ok}, "absolute"},
		{"hard link escaping", []ocitest.TarEntry{{Name: "x", Type: tar.TypeLink, Linkname: "../etc/shadow"}, ok}, "escapes"},
		{"disk is a symlink", []ocitest.TarEntry{{Name: "data", Body: []byte("x")}, {Name: "disk/d.raw", Type: tar.TypeSymlink, Linkname: "../data"}}, "regular file"},
		{"device node", []ocitest.TarEntry{ok, {Name: "dev/sda", Type: tar.TypeBlock}}, "device"},
		{"qcow2 with backing file", []ocitest.TarEntry{{Name: "disk/b.qcow2", Body: backing()}}, "backing file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := testCtx(t)
			layerTar := ocitest.Tar(tc.entries...)
			ref := "hostile/os:" + strconv.Itoa(i)
			skopeoPush(t, reg, ref, ocitest.LayoutImage{Platform: ocispec.Platform{OS: "linux", Architecture: "amd64"}, Layers: [][]byte{layerTar}})
			_, err := s.Pull(ctx, reg.Addr+"/"+ref, PullOptions{})
			t.Logf("error: %v", err)
			require.ErrorIs(t, err, ErrHostileContent)
			require.ErrorContains(t, err, tc.msg)
			assertNothingCached(t, s, digest.FromBytes(layerTar))
		})
	}
}

func TestGCKeepsInUseImages(t *testing.T) {
	ctx := testCtx(t)
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	pushRawDisk(t, reg, "gc/a:1", 512<<10)
	pushRawDisk(t, reg, "gc/b:1", 256<<10)
	s := openStore(t, "", Options{})
	a, err := s.Pull(ctx, reg.Addr+"/gc/a:1", PullOptions{})
	require.NoError(t, err)
	b, err := s.Pull(ctx, reg.Addr+"/gc/b:1", PullOptions{})
	require.NoError(t, err)

	release, err := s.Acquire(a.Digest)
	require.NoError(t, err)
	require.Equal(t, 1, findCached(t, s, a.Digest).InUse)
	// Derived data next to each image (AuxDir) lives and dies with it.
	auxA, err := s.AuxDir(a.Digest, "snapshots")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(auxA, "state"), []byte("a"), 0o400))
	auxB, err := s.AuxDir(b.Digest, "snapshots")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(auxB, "state"), []byte("b"), 0o400))
	_, err = s.AuxDir(a.Digest, "../x")
	require.ErrorContains(t, err, "want 1-63 characters")
	_, err = s.AuxDir("sha256:"+strings.Repeat("0", 64), "snapshots")
	require.ErrorContains(t, err, "is not cached")

	res, err := s.GC(ctx, GCPolicy{MaxBytes: 1})
	require.NoError(t, err)
	require.Equal(t, []string{b.Digest}, res.Removed)
	require.Equal(t, 1, res.KeptInUse)
	require.Equal(t, b.Size, res.FreedBytes)
	require.FileExists(t, a.Disk)
	require.NoFileExists(t, b.Disk)
	require.FileExists(t, filepath.Join(auxA, "state"))
	require.NoDirExists(t, auxB, "GC removes an image's aux data with it")
	require.Len(t, s.List(), 1)

	// By age: the in-use image survives MaxAge too, until released.
	time.Sleep(20 * time.Millisecond)
	res, err = s.GC(ctx, GCPolicy{MaxAge: time.Millisecond})
	require.NoError(t, err)
	require.Empty(t, res.Removed)
	release()
	release() // idempotent
	time.Sleep(20 * time.Millisecond)
	res, err = s.GC(ctx, GCPolicy{MaxAge: time.Millisecond})
	require.NoError(t, err)
	require.Equal(t, []string{a.Digest}, res.Removed)
	require.Empty(t, s.List())
	require.NoDirExists(t, auxA)
	_, err = s.Acquire(a.Digest)
	require.ErrorIs(t, err, ErrNotFound)
	var blobs int
	require.NoError(t, s.content.Walk(ctx, func(content.Info) error { blobs++; return nil }))
	require.Zero(t, blobs, "GC drops blobs of removed images")
}

func findCached(t *testing.T, s *Store, d string) CachedImage {
	t.Helper()
	for _, c := range s.List() {
		if c.Digest == d {
			return c
		}
	}
	t.Fatalf("%s not cached", d)
	return CachedImage{}
}

func TestRestartKeepsCacheAndDropsHalfWrittenEntries(t *testing.T) {
	ctx := testCtx(t)
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	disk, _ := pushRawDisk(t, reg, "restart/os:1", 256<<10)
	root := t.TempDir()
	s, err := Open(root, Options{})
	require.NoError(t, err)
	_, err = Open(root, Options{})
	require.ErrorContains(t, err, "in use by another process")
	img, err := s.Pull(ctx, reg.Addr+"/restart/os:1", PullOptions{})
	require.NoError(t, err)
	require.NoError(t, s.Close())

	// Simulate a crash mid-pull: an unfinished entry in tmp/, and an entry
	// directory whose metadata was never completed.
	require.NoError(t, os.MkdirAll(filepath.Join(root, "tmp", "sha256-abc-123"), 0o755))
	fake := digest.FromString("half")
	half := filepath.Join(root, "images", entryDirName(fake))
	require.NoError(t, os.MkdirAll(half, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(half, "disk.raw"), []byte("partial"), 0o644))
	broken := filepath.Join(root, "images", entryDirName(digest.FromString("broken")))
	require.NoError(t, os.MkdirAll(broken, 0o755))
	m, _ := json.Marshal(entryMeta{Digest: digest.FromString("broken"), Disk: "disk.raw"})
	require.NoError(t, os.WriteFile(filepath.Join(broken, "meta.json"), m, 0o644)) // disk missing

	s = openStore(t, root, Options{})
	list := s.List()
	require.Len(t, list, 1)
	require.Equal(t, img.Digest, list[0].Digest)
	require.Contains(t, list[0].Names, reg.Addr+"/restart/os:1")
	again, err := s.Pull(ctx, reg.Addr+"/restart/os:1", PullOptions{Policy: PullNever})
	require.NoError(t, err)
	require.Equal(t, disk, fileBytes(t, again.Disk))
	require.NoDirExists(t, half)
	require.NoDirExists(t, broken)
	require.NoDirExists(t, filepath.Join(root, "tmp", "sha256-abc-123"))
	_, err = s.Acquire(fake.String())
	require.ErrorIs(t, err, ErrNotFound)
}

func TestPullThroughMirror(t *testing.T) {
	ctx := testCtx(t)
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	disk, layer := pushRawDisk(t, reg, "library/os:1", 64<<10)
	proxy := ocitest.NewProxy(t, reg.Addr)
	s := openStore(t, "", Options{Registries: map[string]RegistryConfig{
		"registry.invalid": {Mirrors: []string{"http://" + proxy.Addr}},
	}})
	img, err := s.Pull(ctx, "registry.invalid/library/os:1", PullOptions{})
	require.NoError(t, err)
	require.Equal(t, disk, fileBytes(t, img.Disk))
	require.Equal(t, 1, proxy.BlobGETs(layer.String()))
	require.Contains(t, s.List()[0].Names, "registry.invalid/library/os:1")
}

func TestStalledDownloadTimesOut(t *testing.T) {
	ctx := testCtx(t)
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	disk, layer := pushRawDisk(t, reg, "stall/os:1", 2<<20)
	proxy := ocitest.NewProxy(t, reg.Addr)
	proxy.AddFault(&ocitest.Fault{Match: layer.String(), CutAfter: 512 << 10, Stall: true})
	s := openStore(t, "", Options{StallTimeout: time.Second})
	_, err := s.Pull(ctx, proxy.Addr+"/stall/os:1", PullOptions{})
	t.Logf("error: %v", err)
	require.ErrorIs(t, err, ErrRegistryUnavailable)
	require.ErrorContains(t, err, "no data received")
	require.Empty(t, s.List())
	img, err := s.Pull(ctx, proxy.Addr+"/stall/os:1", PullOptions{})
	require.NoError(t, err)
	require.Equal(t, disk, fileBytes(t, img.Disk))
}
