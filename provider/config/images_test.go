package config

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestImagesConfig(t *testing.T) {
	c, err := Decode([]byte(header))
	require.NoError(t, err)
	n, err := Resolve(c, env)
	require.NoError(t, err)
	assert.Equal(t, ImageCache{GCMaxBytes: 20 << 30, GCMaxAge: 168 * time.Hour, GCPeriod: 5 * time.Minute}, n.Images)

	c, err = Decode([]byte(header + `
images:
  gcMaxSize: 0
  gcMaxUnusedAge: 0s
  gcPeriod: 30s
  registries:
    registry.lab:5000: {plainHTTP: true, mirrors: [mirror.lab, "http://10.0.0.9:5000/prefix"]}
`))
	require.NoError(t, err)
	n, err = Resolve(c, env)
	require.NoError(t, err)
	assert.Equal(t, ImageCache{GCPeriod: 30 * time.Second, Registries: map[string]Registry{
		"registry.lab:5000": {PlainHTTP: true, Mirrors: []string{"mirror.lab", "http://10.0.0.9:5000/prefix"}},
	}}, n.Images)

	c, err = Decode([]byte(header + `
images:
  gcMaxSize: -1Gi
  gcMaxUnusedAge: soon
  gcPeriod: 10ms
  registries:
    "bad/host": {}
    ok.lab: {mirrors: ["ftp://x", ""]}
`))
	require.NoError(t, err)
	_, err = Resolve(c, env)
	require.Error(t, err)
	for _, want := range []string{"images.gcMaxSize", "images.gcMaxUnusedAge", "images.gcPeriod", "images.registries[bad/host]", "images.registries[ok.lab].mirrors[0]", "images.registries[ok.lab].mirrors[1]"} {
		assert.Contains(t, err.Error(), want)
	}
}
