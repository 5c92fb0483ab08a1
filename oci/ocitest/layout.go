package ocitest

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// TarEntry is one entry of a layer built by Tar.
type TarEntry struct {
	Name     string
	Body     []byte
	Type     byte // tar.TypeReg (default), tar.TypeDir, tar.TypeSymlink, tar.TypeLink
	Linkname string
}

// Tar builds an uncompressed tar layer. Writing to memory cannot fail except
// for invalid headers, which are programming errors: it panics then.
func Tar(entries ...TarEntry) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := &tar.Header{Name: e.Name, Typeflag: e.Type, Linkname: e.Linkname, Mode: 0o644, Size: int64(len(e.Body)), Uid: 107, Gid: 107}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Typeflag != tar.TypeReg {
			h.Size = 0
		}
		if h.Typeflag == tar.TypeDir {
			h.Mode = 0o755
		}
		if err := tw.WriteHeader(h); err != nil {
			panic(fmt.Sprintf("tar header %q: %v", e.Name, err))
		}
		if h.Size > 0 {
			if _, err := tw.Write(e.Body); err != nil {
				panic(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		panic(err)
	}
	return buf.Bytes()
}

// LayoutImage is one platform image of an OCI layout.
type LayoutImage struct {
	Platform       ocispec.Platform
	Layers         [][]byte
	LayerMediaType string // default ocispec.MediaTypeImageLayer
}

// WriteLayout writes an OCI image layout at dir with tag pointing at the
// single image, or at an image index when more than one image is given.
// Push it with: skopeo copy [--all] oci:<dir>:<tag> docker://...
func WriteLayout(tb testing.TB, dir, tag string, imgs ...LayoutImage) {
	tb.Helper()
	blobs := filepath.Join(dir, "blobs", "sha256")
	if err := os.MkdirAll(blobs, 0o755); err != nil {
		tb.Fatal(err)
	}
	put := func(mt string, b []byte) ocispec.Descriptor {
		d := digest.FromBytes(b)
		if err := os.WriteFile(filepath.Join(blobs, d.Encoded()), b, 0o644); err != nil {
			tb.Fatal(err)
		}
		return ocispec.Descriptor{MediaType: mt, Digest: d, Size: int64(len(b))}
	}
	mustJSON := func(v any) []byte {
		b, err := json.Marshal(v)
		if err != nil {
			tb.Fatal(err)
		}
		return b
	}
	var manifests []ocispec.Descriptor
	for _, img := range imgs {
		mt := img.LayerMediaType
		if mt == "" {
			mt = ocispec.MediaTypeImageLayer
		}
		var layers []ocispec.Descriptor
		var diffIDs []digest.Digest
		for _, l := range img.Layers {
			layers = append(layers, put(mt, l))
			diffIDs = append(diffIDs, digest.FromBytes(l)) // exact for uncompressed layers only
		}
		cfg := ocispec.Image{Platform: img.Platform, RootFS: ocispec.RootFS{Type: "layers", DiffIDs: diffIDs}}
		cfgDesc := put(ocispec.MediaTypeImageConfig, mustJSON(cfg))
		m := ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest, Config: cfgDesc, Layers: layers}
		m.SchemaVersion = 2
		md := put(ocispec.MediaTypeImageManifest, mustJSON(m))
		p := img.Platform
		md.Platform = &p
		manifests = append(manifests, md)
	}
	top := manifests[0]
	top.Platform = nil
	if len(manifests) > 1 {
		idx := ocispec.Index{MediaType: ocispec.MediaTypeImageIndex, Manifests: manifests}
		idx.SchemaVersion = 2
		top = put(ocispec.MediaTypeImageIndex, mustJSON(idx))
	}
	top.Annotations = map[string]string{ocispec.AnnotationRefName: tag}
	outer := ocispec.Index{Manifests: []ocispec.Descriptor{top}}
	outer.SchemaVersion = 2
	if err := os.WriteFile(filepath.Join(dir, "index.json"), mustJSON(outer), 0o644); err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644); err != nil {
		tb.Fatal(err)
	}
}
