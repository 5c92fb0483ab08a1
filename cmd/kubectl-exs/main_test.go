package main

import (
	"bytes"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestBadFlags: flag mistakes fail before any API call, saying what is
// wrong; a missing kubeconfig is named.
func TestBadFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"lease", "rpi4", "--timeout", "1m"}, "--timeout needs --wait"},
		{[]string{"lease", "rpi4", "-o", "yaml"}, `--output "yaml": supported: name`},
		{[]string{"lease", "rpi4", "--wait", "--timeout", "-1s"}, "must not be negative"},
		{[]string{"lease"}, "accepts 1 arg(s), received 0"},
		{[]string{"release", "a", "b"}, "accepts 1 arg(s), received 2"},
		{[]string{"lease", "rpi4", "--for", "soon"}, `invalid argument "soon" for "--for"`},
		{[]string{"--kubeconfig", filepath.Join(t.TempDir(), "none"), "list"}, "load kubeconfig"},
	} {
		var out, errOut bytes.Buffer
		cmd := newCommand(&out, &errOut)
		cmd.SetArgs(tc.args)
		err := cmd.Execute()
		if assert.Error(t, err, "%v", tc.args) {
			assert.Contains(t, err.Error(), tc.want, "%v", tc.args)
		}
		assert.Empty(t, out.String(), "%v", tc.args)
	}
}
