package v1alpha1

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// TestLeaseHookImageForms: a flash step's image names a tag or a digest.
func TestLeaseHookImageForms(t *testing.T) {
	digest := "@sha256:" + strings.Repeat("0a", 32)
	for _, ok := range []string{"reg.example/os:1", "localhost:5000/lab/os:v1.2_rc-3", "reg.example/os" + digest, "reg.example/os:1" + digest, "debian:13", "reg.example/a__b/c--d:x"} {
		assert.NoError(t, LeaseHookStep{Action: LeaseHookFlash, Flash: &LeaseHookFlashSpec{Image: ok}}.Check(), ok)
	}
	for _, bad := range []string{"", "reg.example/os", "oci://reg.example/os:1", "Reg.example/OS:1", "reg.example/os:", "reg.example/os@sha256:abc", "reg.example/os:1 ; rm", "/os:1",
		"reg.example/" + strings.Repeat("a", 510) + ":1"} {
		err := LeaseHookStep{Action: LeaseHookFlash, Flash: &LeaseHookFlashSpec{Image: bad}}.Check()
		require.Error(t, err, bad)
		assert.Contains(t, err.Error(), "want an OCI reference with a tag or a digest", bad)
	}
}

// TestLeaseHookImagePatternInCRD: the CRD checks a flash step's image with
// LeaseHookImagePattern, as Check does.
func TestLeaseHookImagePatternInCRD(t *testing.T) {
	root, err := testutil.RepoRoot()
	require.NoError(t, err)
	for _, crd := range []string{"qemu-kubelet.io_exportersets.yaml", "qemu-kubelet.io_virtualtargetclasses.yaml"} {
		b, err := os.ReadFile(filepath.Join(root, "config", "crd", crd))
		require.NoError(t, err)
		assert.Equal(t, 2, strings.Count(string(b), "pattern: "+LeaseHookImagePattern), "%s: beforeLease and afterLease", crd)
	}
}
