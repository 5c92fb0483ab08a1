package oci

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
)

// FuzzPlanManifest: any manifest JSON is planned or refused with an error,
// never a panic; a plan only names layers of the manifest, and a files
// plan has a kernel or a disk.
func FuzzPlanManifest(f *testing.F) {
	for _, s := range []string{
		`{"schemaVersion":2,"layers":[{"mediaType":"application/vnd.qemu-kubelet.kernel.v1","digest":"sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","size":10}]}`,
		`{"schemaVersion":2,"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb","size":10}]}`,
		`{"schemaVersion":2,"layers":[{"mediaType":"application/octet-stream","digest":"sha256:cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc","size":1,"annotations":{"org.opencontainers.image.title":"vmlinuz"}},{"mediaType":"application/octet-stream","digest":"sha256:dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd","size":1,"annotations":{"org.opencontainers.image.title":"initrd.img.gz"}}]}`,
		`{"schemaVersion":2,"layers":[{"mediaType":"application/octet-stream","digest":"sha256:eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee","size":1,"annotations":{"org.opencontainers.image.title":"disk.qcow2.zst"}}]}`,
		`{"schemaVersion":2,"layers":[]}`,
		`{"layers":[{"mediaType":"application/vnd.qemu-kubelet.initrd.v1"}]}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var m ocispec.Manifest
		if json.Unmarshal(data, &m) != nil {
			return
		}
		p, err := planManifest(m)
		if err != nil {
			if err.Error() == "" {
				t.Fatal("empty error")
			}
			return
		}
		inManifest := func(d ocispec.Descriptor) bool {
			for _, l := range m.Layers {
				if l.Digest == d.Digest && l.MediaType == d.MediaType {
					return true
				}
			}
			return false
		}
		switch p.Format {
		case FormatFiles:
			if len(p.Files) == 0 {
				t.Fatalf("files plan without files: %+v", p)
			}
			_, k := p.Files[RoleKernel]
			_, d := p.Files[RoleDisk]
			if !k && !d {
				t.Fatalf("files plan with neither kernel nor disk: %+v", p)
			}
			if _, i := p.Files[RoleInitrd]; i && !k {
				t.Fatalf("initrd without a kernel accepted: %+v", p)
			}
			for r, pf := range p.Files {
				if !inManifest(pf.Layer) {
					t.Fatalf("role %s: layer %s not in the manifest", r, pf.Layer.Digest)
				}
			}
		case FormatContainerDisk:
			if len(p.Layers) == 0 {
				t.Fatalf("containerDisk plan without layers")
			}
			for _, l := range p.Layers {
				if !inManifest(l) {
					t.Fatalf("layer %s not in the manifest", l.Digest)
				}
			}
		default:
			t.Fatalf("unknown format %q", p.Format)
		}
	})
}

// FuzzExtractContainerDisk: any byte stream as a containerDisk layer is
// extracted or refused, never a panic; nothing is written outside dst, and
// what is written is the file reported, within the limit.
func FuzzExtractContainerDisk(f *testing.F) {
	disk := bytes.Repeat([]byte("x"), 600)
	f.Add(ocitest.Tar(ocitest.TarEntry{Name: "disk/", Type: tar.TypeDir}, ocitest.TarEntry{Name: "disk/a.raw", Body: disk}))
	f.Add(ocitest.Tar(ocitest.TarEntry{Name: "disk/a.raw", Body: disk}, ocitest.TarEntry{Name: "disk/b.raw", Body: disk}))
	f.Add(ocitest.Tar(ocitest.TarEntry{Name: "../escape", Body: disk}))
	f.Add(ocitest.Tar(ocitest.TarEntry{Name: "disk/l", Type: tar.TypeSymlink, Linkname: "/etc/passwd"}))
	f.Add(ocitest.Tar(ocitest.TarEntry{Name: "etc/x", Body: []byte("y")}, ocitest.TarEntry{Name: "disk/.wh.x", Body: nil}))
	f.Add([]byte("not a tar"))
	const limit = 1 << 20
	f.Fuzz(func(t *testing.T, data []byte) {
		dir := t.TempDir()
		dst := filepath.Join(dir, "out", "disk")
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			t.Fatal(err)
		}
		d, found, err := extractContainerDisk(bytes.NewReader(data), dst, limit)
		var names []string
		_ = filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
			if err == nil && !fi.IsDir() {
				names = append(names, p)
			}
			return nil
		})
		for _, n := range names {
			if n != dst {
				t.Fatalf("wrote %s outside dst %s", n, dst)
			}
		}
		if err != nil || !found {
			return
		}
		if !strings.HasPrefix(d.Name, "disk/") || strings.Contains(d.Name, "..") {
			t.Fatalf("disk name %q", d.Name)
		}
		fi, serr := os.Stat(dst)
		if serr != nil {
			t.Fatalf("found %q but dst: %v", d.Name, serr)
		}
		if fi.Size() != d.Size || d.Size > limit {
			t.Fatalf("size %d on disk, reported %d, limit %d", fi.Size(), d.Size, limit)
		}
	})
}

// FuzzSafeTarPath: an accepted tar path is relative, clean and stays
// inside the extraction root.
func FuzzSafeTarPath(f *testing.F) {
	for _, s := range []string{"disk/a.qcow2", "./disk/a", "../a", "/abs", "disk/../../x", "disk//a", "", "."} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		clean, err := safeTarPath(name)
		if err != nil {
			return
		}
		if filepath.IsAbs(clean) || clean == ".." || strings.HasPrefix(clean, "../") || strings.Contains(clean, "/../") || strings.HasSuffix(clean, "/..") {
			t.Fatalf("safeTarPath(%q) = %q escapes", name, clean)
		}
	})
}
