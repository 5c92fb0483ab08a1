package config

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestFirmwareDefaultsAndValidation: without a firmware section the first
// OVMF pair of DefaultOVMF found on the host is used (none found: UEFI off);
// an explicit pair is kept; half a pair or a relative path is refused.
func TestFirmwareDefaultsAndValidation(t *testing.T) {
	only := func(paths ...string) func(string) bool {
		return func(p string) bool {
			for _, q := range paths {
				if p == q {
					return true
				}
			}
			return false
		}
	}
	cases := []struct {
		name, yaml string
		exists     func(string) bool
		code, vars string
		wantErr    string
	}{
		{"4M pair found", header, only(DefaultOVMF[0][0], DefaultOVMF[0][1], DefaultOVMF[1][0], DefaultOVMF[1][1]), DefaultOVMF[0][0], DefaultOVMF[0][1], ""},
		{"2M pair when 4M is incomplete", header, only(DefaultOVMF[0][0], DefaultOVMF[1][0], DefaultOVMF[1][1]), DefaultOVMF[1][0], DefaultOVMF[1][1], ""},
		{"no OVMF on the host", header, only(), "", "", ""},
		{"explicit pair", header + "firmware: {uefiCode: /opt/fw/CODE.fd, uefiVars: /opt/fw/VARS.fd}\n", only(), "/opt/fw/CODE.fd", "/opt/fw/VARS.fd", ""},
		{"half a pair", header + "firmware: {uefiCode: /opt/fw/CODE.fd}\n", only(), "", "", "set both or neither"},
		{"relative path", header + "firmware: {uefiCode: CODE.fd, uefiVars: /opt/VARS.fd}\n", only(), "", "", "firmware.uefiCode"},
		{"unknown field", header + "firmware: {ovmf: /x}\n", only(), "", "", "ovmf"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Decode([]byte(tc.yaml))
			if err == nil {
				e := env
				e.FileExists = tc.exists
				var n *Node
				n, err = Resolve(c, e)
				if err == nil {
					require.Empty(t, tc.wantErr)
					assert.Equal(t, tc.code, n.UEFICode)
					assert.Equal(t, tc.vars, n.UEFIVars)
					return
				}
			}
			require.NotEmpty(t, tc.wantErr, "unexpected error: %v", err)
			assert.ErrorContains(t, err, tc.wantErr)
		})
	}
}
