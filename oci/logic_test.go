package oci

import (
	"archive/tar"
	"errors"
	"fmt"
	"net/http"
	"testing"

	remoteerrors "github.com/containerd/containerd/v2/core/remotes/errors"
	"github.com/containerd/errdefs"
	"github.com/containerd/platforms"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/stretchr/testify/require"
)

func titled(title, mt string) ocispec.Descriptor {
	d := ocispec.Descriptor{MediaType: mt, Digest: digest.FromString(title + mt), Size: 1}
	if title != "" {
		d.Annotations = map[string]string{ocispec.AnnotationTitle: title}
	}
	return d
}

func TestPlanManifest(t *testing.T) {
	const orasFile = "application/vnd.oci.image.layer.v1.tar"
	for _, tc := range []struct {
		name   string
		layers []ocispec.Descriptor
		format Format
		roles  map[Role]Compression
		err    error
		msg    string
	}{
		{"containerDisk", ocitestLayers{ocispec.MediaTypeImageLayerGzip, ocispec.MediaTypeImageLayer}.descs(), FormatContainerDisk, nil, nil, ""},
		{"kernel initrd cmdline", []ocispec.Descriptor{titled("vmlinuz-6.1.0", orasFile), titled("initrd.img", orasFile), titled("x", MediaTypeCmdline)}, FormatFiles,
			map[Role]Compression{RoleKernel: "", RoleInitrd: "", RoleCmdline: ""}, nil, ""},
		{"compressed disk by title", []ocispec.Descriptor{titled("fedora.qcow2.xz", orasFile)}, FormatFiles, map[Role]Compression{RoleDisk: CompressionXz}, nil, ""},
		{"disk by media type", []ocispec.Descriptor{titled("blob", MediaTypeDisk+"+gzip")}, FormatFiles, map[Role]Compression{RoleDisk: CompressionGzip}, nil, ""},
		{"unknown compression", []ocispec.Descriptor{titled("blob", MediaTypeDisk+"+lz4")}, "", nil, ErrUnsupportedArtifact, "lz4"},
		{"unknown title", []ocispec.Descriptor{titled("notes.txt", orasFile)}, "", nil, ErrUnsupportedArtifact, "notes.txt"},
		{"two disks", []ocispec.Descriptor{titled("a.raw", orasFile), titled("b.qcow2", orasFile)}, "", nil, ErrUnsupportedArtifact, "two disk layers"},
		{"initrd without kernel", []ocispec.Descriptor{titled("initrd", orasFile), titled("d.raw", orasFile)}, "", nil, ErrUnsupportedArtifact, "no kernel"},
		{"helm chart", []ocispec.Descriptor{titled("", "application/vnd.cncf.helm.chart.content.v1.tar+gzip")}, "", nil, ErrUnsupportedArtifact, "application/vnd.cncf.helm.chart.content.v1.tar+gzip"},
		{"no layers", nil, "", nil, ErrUnsupportedArtifact, "no layers"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := planManifest(ocispec.Manifest{Layers: tc.layers, Config: ocispec.Descriptor{MediaType: "application/vnd.oci.empty.v1+json"}})
			if tc.err != nil {
				require.ErrorIs(t, err, tc.err)
				require.ErrorContains(t, err, tc.msg)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.format, p.Format)
			got := map[Role]Compression{}
			for r, f := range p.Files {
				got[r] = f.Compression
			}
			if tc.roles == nil {
				tc.roles = map[Role]Compression{}
			}
			require.Equal(t, tc.roles, got)
		})
	}
}

type ocitestLayers []string

func (l ocitestLayers) descs() []ocispec.Descriptor {
	var out []ocispec.Descriptor
	for i, mt := range l {
		out = append(out, ocispec.Descriptor{MediaType: mt, Digest: digest.FromString(fmt.Sprint(i)), Size: 1})
	}
	return out
}

func TestSafeTarPath(t *testing.T) {
	for _, tc := range []struct {
		name, want string
		bad        bool
	}{
		{"disk/a.qcow2", "disk/a.qcow2", false},
		{"./disk/a.qcow2", "disk/a.qcow2", false},
		{"disk//a", "disk/a", false},
		{"/disk/a", "", true},
		{"../a", "", true},
		{"disk/../../a", "", true},
		{"disk/..", "", true},
		{"", "", true},
		{`disk\..\a`, "", true},
	} {
		got, err := safeTarPath(tc.name)
		if tc.bad {
			require.ErrorIs(t, err, ErrHostileContent, tc.name)
			continue
		}
		require.NoError(t, err, tc.name)
		require.Equal(t, tc.want, got)
	}
}

func TestCheckTarLink(t *testing.T) {
	for _, tc := range []struct {
		h   tar.Header
		bad bool
	}{
		{tar.Header{Name: "disk/l", Typeflag: tar.TypeSymlink, Linkname: "a.qcow2"}, false},
		{tar.Header{Name: "a/b/l", Typeflag: tar.TypeSymlink, Linkname: "../c"}, false},
		{tar.Header{Name: "a/l", Typeflag: tar.TypeSymlink, Linkname: "../../c"}, true},
		{tar.Header{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "/etc/passwd"}, true},
		{tar.Header{Name: "l", Typeflag: tar.TypeLink, Linkname: "disk/a"}, false},
		{tar.Header{Name: "l", Typeflag: tar.TypeLink, Linkname: "../x"}, true},
		{tar.Header{Name: "l", Typeflag: tar.TypeLink, Linkname: "/x"}, true},
	} {
		clean, err := safeTarPath(tc.h.Name)
		require.NoError(t, err)
		err = checkTarLink(&tc.h, clean)
		if tc.bad {
			require.ErrorIs(t, err, ErrHostileContent, "%+v", tc.h)
		} else {
			require.NoError(t, err, "%+v", tc.h)
		}
	}
}

func TestParseDockerConfig(t *testing.T) {
	c, err := parseDockerConfig(
		[]byte(`{"auths":{"https://index.docker.io/v1/":{"auth":"dTpw"},"reg.example:5000":{"username":"a","password":"b"}}}`),
		[]byte(`{"http://reg.example:5000/v2/":{"auth":"YzpkOmU="}}`), // legacy .dockercfg, later wins
		[]byte(`{"auths":{"ghcr.io":{"identitytoken":"tok"}}}`),
	)
	require.NoError(t, err)
	for _, tc := range []struct{ host, user, secret string }{
		{"registry-1.docker.io", "u", "p"},
		{"docker.io", "u", "p"},
		{"reg.example:5000", "c", "d:e"},
		{"ghcr.io", "", "tok"},
		{"other.example", "", ""},
	} {
		u, s, err := c.credentials(tc.host)
		require.NoError(t, err)
		require.Equal(t, [2]string{tc.user, tc.secret}, [2]string{u, s}, tc.host)
	}
	_, err = parseDockerConfig([]byte(`not json`))
	require.ErrorContains(t, err, "not Docker config JSON")
	_, err = parseDockerConfig([]byte(`{"auths":{"x":{"auth":"!!"}}}`))
	require.ErrorContains(t, err, "not base64")
}

func TestSelectPlatform(t *testing.T) {
	p := func(s string) *ocispec.Platform { v := platforms.MustParse(s); return &v }
	idx := ocispec.Index{Manifests: []ocispec.Descriptor{
		{Digest: "sha256:arm", Platform: p("linux/arm64")},
		{Digest: "sha256:amd", Platform: p("linux/amd64")},
		{Digest: "sha256:att", Platform: &ocispec.Platform{OS: "unknown", Architecture: "unknown"}},
	}}
	d, err := selectPlatform(idx, platforms.Only(platforms.MustParse("linux/amd64")), "linux/amd64")
	require.NoError(t, err)
	require.Equal(t, digest.Digest("sha256:amd"), d.Digest)
	_, err = selectPlatform(idx, platforms.Only(platforms.MustParse("linux/s390x")), "linux/s390x")
	require.ErrorIs(t, err, ErrUnsupportedArtifact)
	require.ErrorContains(t, err, "linux/arm64")
}

func TestClassify(t *testing.T) {
	status := func(code int) error {
		return remoteerrors.ErrUnexpectedStatus{StatusCode: code, Status: http.StatusText(code)}
	}
	for _, tc := range []struct {
		err  error
		want error
	}{
		{status(401), ErrUnauthorized},
		{status(403), ErrUnauthorized},
		{status(404), ErrNotFound},
		{status(503), ErrRegistryUnavailable},
		{status(429), ErrRegistryUnavailable},
		{fmt.Errorf("x: %w", errdefs.ErrNotFound), ErrNotFound},
		{fmt.Errorf("failed commit: unexpected commit digest sha256:a, expected sha256:b: %w", errdefs.ErrFailedPrecondition), ErrDigestMismatch},
		{withKind(ErrTooLarge, "big"), ErrTooLarge},
		{errors.New("something odd"), ErrRegistryUnavailable},
	} {
		err := pullError("r", tc.err)
		require.ErrorIs(t, err, tc.want, "%v", tc.err)
		require.ErrorContains(t, err, tc.err.Error(), "the cause is kept")
	}
}
