package oci

import (
	"fmt"
	"path"
	"sort"
	"strings"

	"github.com/containerd/containerd/v2/core/images"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Project media types for OS image file artifacts (see docs/images.md).
// A compressed payload appends "+xz", "+zstd" or "+gzip".
const (
	ArtifactTypeOSImage = "application/vnd.qemu-kubelet.os-image.v1"
	MediaTypeKernel     = "application/vnd.qemu-kubelet.kernel.v1"
	MediaTypeInitrd     = "application/vnd.qemu-kubelet.initrd.v1"
	MediaTypeDisk       = "application/vnd.qemu-kubelet.disk.v1"
	MediaTypeCmdline    = "application/vnd.qemu-kubelet.cmdline.v1"
)

// Format of a pulled image.
type Format string

const (
	FormatContainerDisk Format = "containerDisk"
	FormatFiles         Format = "files"
)

// Role of one file of an OS image.
type Role string

const (
	RoleKernel  Role = "kernel"
	RoleInitrd  Role = "initrd"
	RoleDisk    Role = "disk"
	RoleCmdline Role = "cmdline"
)

// Compression of a file payload.
type Compression string

const (
	CompressionNone Compression = ""
	CompressionGzip Compression = "gzip"
	CompressionZstd Compression = "zstd"
	CompressionXz   Compression = "xz"
)

// plan is the pure decision of what to do with a manifest's layers.
type plan struct {
	Format Format
	// Files: one entry per role (FormatFiles).
	Files map[Role]planFile
	// Layers: tar layers to scan for disk/<file> in order (FormatContainerDisk).
	Layers []ocispec.Descriptor
}

type planFile struct {
	Layer       ocispec.Descriptor
	Compression Compression
}

const annotationTitle = ocispec.AnnotationTitle

// planManifest decides the format and the role of each layer of m, or fails
// with ErrUnsupportedArtifact naming the media types found.
func planManifest(m ocispec.Manifest) (plan, error) {
	if len(m.Layers) == 0 {
		return plan{}, withKind(ErrUnsupportedArtifact, "manifest has no layers (config %s, artifactType %q)", m.Config.MediaType, m.ArtifactType)
	}
	fileLike := false
	for _, l := range m.Layers {
		if l.Annotations[annotationTitle] != "" || strings.HasPrefix(l.MediaType, "application/vnd.qemu-kubelet.") {
			fileLike = true
		}
	}
	if !fileLike {
		for _, l := range m.Layers {
			if !isTarLayer(l.MediaType) {
				return plan{}, withKind(ErrUnsupportedArtifact, "neither a containerDisk (tar layers holding disk/<file>) nor an OS image file artifact (titled layers): media types %s", mediaTypes(m))
			}
		}
		return plan{Format: FormatContainerDisk, Layers: m.Layers}, nil
	}
	p := plan{Format: FormatFiles, Files: map[Role]planFile{}}
	for _, l := range m.Layers {
		role, comp, err := layerRole(l)
		if err != nil {
			return plan{}, err
		}
		if prev, dup := p.Files[role]; dup {
			return plan{}, withKind(ErrUnsupportedArtifact, "two %s layers: %s and %s", role, describe(prev.Layer), describe(l))
		}
		p.Files[role] = planFile{Layer: l, Compression: comp}
	}
	_, hasKernel := p.Files[RoleKernel]
	_, hasDisk := p.Files[RoleDisk]
	if !hasKernel && !hasDisk {
		return plan{}, withKind(ErrUnsupportedArtifact, "file artifact has neither a kernel nor a disk: media types %s", mediaTypes(m))
	}
	if _, ok := p.Files[RoleInitrd]; ok && !hasKernel {
		return plan{}, withKind(ErrUnsupportedArtifact, "file artifact has an initrd but no kernel")
	}
	return p, nil
}

// layerRole classifies a file layer: by project media type first, else by
// its title (file name).
func layerRole(l ocispec.Descriptor) (Role, Compression, error) {
	if strings.HasPrefix(l.MediaType, "application/vnd.qemu-kubelet.") {
		base, suffix, _ := strings.Cut(l.MediaType, "+")
		comp, ok := map[string]Compression{"": CompressionNone, "gzip": CompressionGzip, "zstd": CompressionZstd, "xz": CompressionXz}[suffix]
		if !ok {
			return "", "", withKind(ErrUnsupportedArtifact, "layer %s: unknown compression %q", describe(l), suffix)
		}
		switch base {
		case MediaTypeKernel:
			return RoleKernel, comp, nil
		case MediaTypeInitrd:
			return RoleInitrd, comp, nil
		case MediaTypeDisk:
			return RoleDisk, comp, nil
		case MediaTypeCmdline:
			return RoleCmdline, comp, nil
		}
		return "", "", withKind(ErrUnsupportedArtifact, "layer %s: unknown project media type", describe(l))
	}
	title := l.Annotations[annotationTitle]
	if title == "" {
		return "", "", withKind(ErrUnsupportedArtifact, "layer %s: no title annotation and not a project media type", describe(l))
	}
	if _, unpack := l.Annotations["io.deis.oras.content.unpack"]; unpack {
		return "", "", withKind(ErrUnsupportedArtifact, "layer %s: directory artifacts are not supported; push files", describe(l))
	}
	if role, comp, ok := roleFromTitle(title); ok {
		return role, comp, nil
	}
	return "", "", withKind(ErrUnsupportedArtifact, "layer %s: cannot tell its role from the title; name it vmlinuz*/kernel, initrd*/initramfs*, *.qcow2/*.raw/*.img[.xz|.zst|.gz] or cmdline, or use a %s* media type", describe(l), "application/vnd.qemu-kubelet.")
}

// roleFromTitle maps a file name to a role and a compression.
func roleFromTitle(title string) (Role, Compression, bool) {
	name := strings.ToLower(path.Base(title))
	comp := CompressionNone
	for ext, c := range map[string]Compression{".xz": CompressionXz, ".zst": CompressionZstd, ".gz": CompressionGzip} {
		if strings.HasSuffix(name, ext) {
			comp, name = c, strings.TrimSuffix(name, ext)
			break
		}
	}
	switch {
	case name == "kernel" || name == "bzimage" || strings.HasPrefix(name, "vmlinuz") || strings.HasPrefix(name, "vmlinux"):
		return RoleKernel, comp, true
	case strings.HasPrefix(name, "initrd") || strings.HasPrefix(name, "initramfs"): // before .img: initrd.img
		return RoleInitrd, comp, true
	case strings.HasSuffix(name, ".qcow2"), strings.HasSuffix(name, ".raw"), strings.HasSuffix(name, ".img"):
		return RoleDisk, comp, true
	case name == "cmdline" || name == "cmdline.txt":
		return RoleCmdline, comp, true
	}
	return "", "", false
}

// isTarLayer reports whether mt is a (possibly compressed) tar layer.
func isTarLayer(mt string) bool {
	switch mt {
	case ocispec.MediaTypeImageLayer, ocispec.MediaTypeImageLayerGzip, ocispec.MediaTypeImageLayerZstd,
		images.MediaTypeDockerSchema2Layer, images.MediaTypeDockerSchema2LayerGzip:
		return true
	}
	return false
}

// tarCompression returns the compression of a tar layer media type.
func tarCompression(mt string) Compression {
	switch mt {
	case ocispec.MediaTypeImageLayerGzip, images.MediaTypeDockerSchema2LayerGzip:
		return CompressionGzip
	case ocispec.MediaTypeImageLayerZstd:
		return CompressionZstd
	}
	return CompressionNone
}

func describe(l ocispec.Descriptor) string {
	if t := l.Annotations[annotationTitle]; t != "" {
		return fmt.Sprintf("%q (%s, %s)", t, l.MediaType, l.Digest)
	}
	return fmt.Sprintf("%s (%s)", l.Digest, l.MediaType)
}

func mediaTypes(m ocispec.Manifest) string {
	seen := map[string]bool{}
	var out []string
	for _, l := range m.Layers {
		if !seen[l.MediaType] {
			seen[l.MediaType] = true
			out = append(out, l.MediaType)
		}
	}
	sort.Strings(out)
	return fmt.Sprintf("[%s] (config %s)", strings.Join(out, ", "), m.Config.MediaType)
}
