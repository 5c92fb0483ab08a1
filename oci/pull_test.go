package oci

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"archive/tar"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
)

// --- fixtures -------------------------------------------------------------

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func openStore(t *testing.T, root string, o Options) *Store {
	t.Helper()
	if root == "" {
		root = t.TempDir()
	}
	s, err := Open(root, o)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// qcow2 creates a small qcow2 image with some data in it and returns its bytes.
func qcow2(t *testing.T, dir string) []byte {
	t.Helper()
	p := filepath.Join(dir, "base.qcow2")
	ocitest.Run(testCtx(t), t, dir, "qemu-img", "create", "-q", "-f", "qcow2", p, "64M")
	ocitest.Run(testCtx(t), t, dir, "qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 1M 256k", p)
	b, err := os.ReadFile(p)
	require.NoError(t, err)
	return b
}

func randomBytes(t testing.TB, n int) []byte {
	b := make([]byte, n)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return b
}

// skopeoPush writes an OCI layout and pushes it with skopeo.
func skopeoPush(t *testing.T, reg *ocitest.Registry, ref string, imgs ...ocitest.LayoutImage) {
	t.Helper()
	dir := t.TempDir()
	ocitest.WriteLayout(t, dir, "v1", imgs...)
	args := []string{"copy", "--quiet", "--all", "--dest-tls-verify=false", "--preserve-digests", "oci:" + dir + ":v1", "docker://" + reg.Addr + "/" + ref}
	if reg.User != "" {
		args = append(args, "--dest-creds", reg.User+":"+reg.Pass)
	}
	ocitest.Run(testCtx(t), t, "", "skopeo", args...)
}

// orasPush pushes files (names relative to dir, optionally "name:mediatype").
func orasPush(t *testing.T, reg *ocitest.Registry, ref, dir string, files ...string) {
	t.Helper()
	args := []string{"push", "--no-tty", "--plain-http", "--artifact-type", ArtifactTypeOSImage, reg.Addr + "/" + ref}
	if reg.User != "" {
		args = append(args, "-u", reg.User, "-p", reg.Pass)
	}
	ocitest.Run(testCtx(t), t, dir, ocitest.Oras(t), append(args, files...)...)
}

func containerDisk(disk []byte, name string) ocitest.LayoutImage {
	return ocitest.LayoutImage{
		Platform: ocispec.Platform{OS: "linux", Architecture: "amd64"},
		Layers:   [][]byte{tarOf(ocitest.TarEntry{Name: "disk/", Type: tar.TypeDir}, ocitest.TarEntry{Name: "disk/" + name, Body: disk})},
	}
}

func tarOf(entries ...ocitest.TarEntry) []byte { return ocitest.Tar(entries...) }

func dockerConfigJSON(host, user, pass string) []byte {
	return []byte(fmt.Sprintf(`{"auths":{%q:{"auth":%q}}}`, host, base64.StdEncoding.EncodeToString([]byte(user+":"+pass))))
}

func fileBytes(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	require.NoError(t, err)
	return b
}

// assertNothingCached checks that a failed pull left no entry, no layer blob
// and no temporary directory behind.
func assertNothingCached(t *testing.T, s *Store, layer digest.Digest) {
	t.Helper()
	require.Empty(t, s.List())
	if layer != "" {
		_, err := os.Stat(s.blobPath(layer))
		require.True(t, os.IsNotExist(err), "layer blob %s must not be in the content store", layer)
	}
	tmp, err := os.ReadDir(filepath.Join(s.root, "tmp"))
	require.NoError(t, err)
	require.Empty(t, tmp)
	imgs, err := os.ReadDir(filepath.Join(s.root, "images"))
	require.NoError(t, err)
	require.Empty(t, imgs)
}

// --- formats --------------------------------------------------------------

func TestPullContainerDisk(t *testing.T) {
	ctx := testCtx(t)
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	disk := qcow2(t, t.TempDir())
	skopeoPush(t, reg, "containerdisks/test:v1", containerDisk(disk, "test.qcow2"))

	s := openStore(t, "", Options{})
	var last Progress
	img, err := s.Pull(ctx, reg.Addr+"/containerdisks/test:v1", PullOptions{Progress: func(p Progress) { last = p }})
	require.NoError(t, err)
	require.Equal(t, FormatContainerDisk, img.Format)
	require.Equal(t, "qcow2", img.DiskFormat)
	require.Equal(t, disk, fileBytes(t, img.Disk))
	require.Empty(t, img.Kernel)
	require.Equal(t, int64(len(disk)), img.Size)
	require.Greater(t, last.Total, int64(len(disk)))
	require.Equal(t, last.Total, last.Done)
	out := ocitest.Run(ctx, t, "", "qemu-img", "info", "--output=json", img.Disk)
	require.Contains(t, out, `"format": "qcow2"`)

	list := s.List()
	require.Len(t, list, 1)
	require.Equal(t, img.Digest, list[0].Digest)
	require.Contains(t, list[0].Names, reg.Addr+"/containerdisks/test:v1")
	require.Contains(t, list[0].Names, reg.Addr+"/containerdisks/test@"+img.Digest)

	// Served from the cache without the registry (Never would fail otherwise).
	again, err := s.Pull(ctx, reg.Addr+"/containerdisks/test:v1", PullOptions{Policy: PullNever})
	require.NoError(t, err)
	require.Equal(t, img.Disk, again.Disk)
	byDigest, err := s.Pull(ctx, reg.Addr+"/containerdisks/test@"+img.Digest, PullOptions{Policy: PullNever})
	require.NoError(t, err)
	require.Equal(t, img.Disk, byDigest.Disk)
}

func TestPullCompressedContainerDiskLayers(t *testing.T) {
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	s := openStore(t, "", Options{})
	disk := randomBytes(t, 512<<10)
	layer := tarOf(ocitest.TarEntry{Name: "disk/", Type: tar.TypeDir}, ocitest.TarEntry{Name: "disk/d.raw", Body: disk})
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "layer.tar"), layer, 0o644))
	ctx := testCtx(t)
	ocitest.Run(ctx, t, dir, "gzip", "-k", "layer.tar")
	ocitest.Run(ctx, t, dir, "zstd", "-q", "layer.tar")
	for _, tc := range []struct{ name, file, mediaType string }{
		{"gzip", "layer.tar.gz", ocispec.MediaTypeImageLayerGzip},
		{"zstd", "layer.tar.zst", ocispec.MediaTypeImageLayerZstd},
	} {
		t.Run(tc.name, func(t *testing.T) {
			img := ocitest.LayoutImage{
				Platform:       ocispec.Platform{OS: "linux", Architecture: "amd64"},
				Layers:         [][]byte{fileBytes(t, filepath.Join(dir, tc.file))},
				LayerMediaType: tc.mediaType,
			}
			skopeoPush(t, reg, "cd/compressed:"+tc.name, img)
			got, err := s.Pull(testCtx(t), reg.Addr+"/cd/compressed:"+tc.name, PullOptions{})
			require.NoError(t, err)
			require.Equal(t, "raw", got.DiskFormat)
			require.Equal(t, disk, fileBytes(t, got.Disk))
		})
	}
}

func TestPullKernelInitrdFiles(t *testing.T) {
	ctx := testCtx(t)
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	dir := t.TempDir()
	kernel, initrd := randomBytes(t, 300<<10), randomBytes(t, 200<<10)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "vmlinuz-6.1"), kernel, 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "initrd.img"), initrd, 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "args"), []byte("console=ttyS0 quiet\n"), 0o644))
	orasPush(t, reg, "os/tiny:1", dir, "vmlinuz-6.1", "initrd.img", "args:"+MediaTypeCmdline)

	s := openStore(t, "", Options{})
	img, err := s.Pull(ctx, reg.Addr+"/os/tiny:1", PullOptions{})
	require.NoError(t, err)
	require.Equal(t, FormatFiles, img.Format)
	require.Equal(t, kernel, fileBytes(t, img.Kernel))
	require.Equal(t, initrd, fileBytes(t, img.Initrd))
	require.Equal(t, "console=ttyS0 quiet", img.Cmdline)
	require.Empty(t, img.Disk)
	require.Equal(t, int64(len(kernel)+len(initrd)), img.Size)
	fi, err := os.Stat(img.Kernel)
	require.NoError(t, err)
	require.Zero(t, fi.Mode().Perm()&0o222, "cached files are read-only")
	require.Equal(t, os.FileMode(0o444), fi.Mode().Perm(), "cached files are readable by QEMU run as another user")
	di, err := os.Stat(filepath.Dir(img.Kernel))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o755), di.Mode().Perm(), "the image's directory is searchable by QEMU run as another user")

	// An entry unpacked before (a 0700 directory) is opened up on Open.
	root := s.root
	require.NoError(t, s.Close())
	require.NoError(t, os.Chmod(filepath.Dir(img.Kernel), 0o700))
	openStore(t, root, Options{})
	di, err = os.Stat(filepath.Dir(img.Kernel))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o755), di.Mode().Perm(), "an older 0700 entry is opened up")
}

func TestPullCompressedDisk(t *testing.T) {
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	s := openStore(t, "", Options{})
	raw := append(randomBytes(t, 1<<20), make([]byte, 3<<20)...)
	for _, tc := range []struct {
		name, file, mediaType string
		compress              []string
	}{
		{"xz by title", "disk.raw.xz", "", []string{"xz", "-T1", "-0", "-k"}},
		{"zstd by title", "disk.img.zst", "", []string{"zstd", "-q", "-1"}},
		{"gzip by title", "disk.raw.gz", "", []string{"gzip", "-1", "-k"}},
		{"zstd by media type", "payload", MediaTypeDisk + "+zstd", []string{"zstd", "-q", "-1"}},
		{"qcow2 uncompressed", "disk.qcow2", "", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := testCtx(t)
			dir := t.TempDir()
			want := raw
			src := "disk.raw"
			if tc.compress == nil {
				want = qcow2(t, dir)
				require.NoError(t, os.Rename(filepath.Join(dir, "base.qcow2"), filepath.Join(dir, tc.file)))
			} else {
				require.NoError(t, os.WriteFile(filepath.Join(dir, src), raw, 0o644))
				ocitest.Run(ctx, t, dir, tc.compress[0], append(tc.compress[1:], src)...)
				ext := map[string]string{"xz": ".xz", "zstd": ".zst", "gzip": ".gz"}[tc.compress[0]]
				require.NoError(t, os.Rename(filepath.Join(dir, src+ext), filepath.Join(dir, tc.file)))
			}
			arg := tc.file
			if tc.mediaType != "" {
				arg += ":" + tc.mediaType
			}
			ref := "os/disk:" + strings.ReplaceAll(tc.name, " ", "-")
			orasPush(t, reg, ref, dir, arg)
			img, err := s.Pull(ctx, reg.Addr+"/"+ref, PullOptions{})
			require.NoError(t, err)
			require.Equal(t, want, fileBytes(t, img.Disk))
			if tc.compress == nil {
				require.Equal(t, "qcow2", img.DiskFormat)
			} else {
				require.Equal(t, "raw", img.DiskFormat)
			}
		})
	}
}

func TestPullMultiArchIndex(t *testing.T) {
	ctx := testCtx(t)
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	amd, arm := randomBytes(t, 64<<10), randomBytes(t, 64<<10)
	armImg := containerDisk(arm, "disk.raw")
	armImg.Platform = ocispec.Platform{OS: "linux", Architecture: "arm64", Variant: "v8"}
	skopeoPush(t, reg, "multi/os:1", armImg, containerDisk(amd, "disk.raw"))

	s := openStore(t, "", Options{Platform: "linux/amd64"})
	img, err := s.Pull(ctx, reg.Addr+"/multi/os:1", PullOptions{})
	require.NoError(t, err)
	require.Equal(t, amd, fileBytes(t, img.Disk))
	require.NotEqual(t, img.Digest, img.ManifestDigest, "the reference names the index")

	s2 := openStore(t, "", Options{Platform: "linux/riscv64"})
	_, err = s2.Pull(ctx, reg.Addr+"/multi/os:1", PullOptions{})
	require.ErrorIs(t, err, ErrUnsupportedArtifact)
	require.ErrorContains(t, err, "linux/arm64/v8")
}

// --- registry errors -------------------------------------------------------

func TestPullPrivateRepository(t *testing.T) {
	ctx := testCtx(t)
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{User: "alice", Pass: "s3cret"})
	dir := t.TempDir()
	disk := randomBytes(t, 128<<10)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "disk.raw"), disk, 0o644))
	orasPush(t, reg, "private/os:1", dir, "disk.raw")
	ref := reg.Addr + "/private/os:1"

	for _, tc := range []struct {
		name  string
		auth  [][]byte
		creds *Credentials
		want  error
	}{
		{"no credentials", nil, nil, ErrUnauthorized},
		{"call credentials", nil, &Credentials{Username: "alice", Password: "s3cret"}, nil},
		{"call credentials win over a pull secret", [][]byte{dockerConfigJSON(reg.Addr, "alice", "wrong")}, &Credentials{Username: "alice", Password: "s3cret"}, nil},
		{"wrong call credentials", [][]byte{dockerConfigJSON(reg.Addr, "alice", "s3cret")}, &Credentials{Username: "alice", Password: "n0t-it"}, ErrUnauthorized},
		{"wrong password", [][]byte{dockerConfigJSON(reg.Addr, "alice", "wrong")}, nil, ErrUnauthorized},
		{"credentials for another registry", [][]byte{dockerConfigJSON("other.example:5000", "alice", "s3cret")}, nil, ErrUnauthorized},
		{"good credentials, URL key", [][]byte{dockerConfigJSON("http://"+reg.Addr+"/v2/", "alice", "s3cret")}, nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := openStore(t, "", Options{})
			img, err := s.Pull(ctx, ref, PullOptions{Auth: tc.auth, Credentials: tc.creds})
			if tc.want != nil {
				t.Logf("error: %v", err)
				require.ErrorIs(t, err, tc.want)
				if tc.creds != nil {
					require.NotContains(t, err.Error(), tc.creds.Password, "the password is not in the error")
				}
				var pe *PullError
				require.ErrorAs(t, err, &pe)
				require.Contains(t, err.Error(), ref)
				assertNothingCached(t, s, "")
				return
			}
			require.NoError(t, err)
			require.Equal(t, disk, fileBytes(t, img.Disk))
		})
	}
}

func TestPullErrors(t *testing.T) {
	ctx := testCtx(t)
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "README.md"), []byte("hello"), 0o644))
	orasPush(t, reg, "misc/readme:1", dir, "README.md")
	skopeoPush(t, reg, "misc/nodisk:1", ocitest.LayoutImage{
		Platform: ocispec.Platform{OS: "linux", Architecture: "amd64"},
		Layers:   [][]byte{tarOf(ocitest.TarEntry{Name: "etc/hostname", Body: []byte("x")})},
	})
	skopeoPush(t, reg, "misc/big:1", containerDisk(randomBytes(t, 256<<10), "d.raw"))

	s := openStore(t, "", Options{Limits: Limits{MaxBlobBytes: 100 << 10}})
	for _, tc := range []struct {
		name, ref string
		want      error
		msg       string
	}{
		{"missing tag", reg.Addr + "/misc/readme:nope", ErrNotFound, "not found"},
		{"missing repository", reg.Addr + "/nope/nope:1", ErrNotFound, "not found"},
		{"bad reference", "UPPER/Case::x", ErrInvalidReference, "invalid"},
		{"unknown file", reg.Addr + "/misc/readme:1", ErrUnsupportedArtifact, `"README.md"`},
		{"tar without disk/", reg.Addr + "/misc/nodisk:1", ErrUnsupportedArtifact, "no file under disk/"},
		{"layer over limit", reg.Addr + "/misc/big:1", ErrTooLarge, "limit 102400"},
		{"registry down", "127.0.0.1:1/x/y:1", ErrRegistryUnavailable, "pull"},
		{"policy Never, not cached", reg.Addr + "/misc/readme:1", ErrNotFound, "pull policy is Never"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := PullOptions{}
			if strings.HasPrefix(tc.name, "policy Never") {
				o.Policy = PullNever
			}
			_, err := s.Pull(ctx, tc.ref, o)
			t.Logf("error: %v", err)
			require.ErrorIs(t, err, tc.want)
			require.ErrorContains(t, err, tc.msg)
			require.Empty(t, s.List())
		})
	}
}
