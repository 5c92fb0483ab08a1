package config

import (
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestResolveLeases(t *testing.T) {
	c, err := Decode([]byte("apiVersion: qemu-kubelet.io/v1alpha1\nkind: NodeConfiguration\n"))
	require.NoError(t, err)
	n, err := Resolve(c, env)
	require.NoError(t, err)
	assert.Equal(t, LeasesConfig{MaxConcurrentTransfers: 4, TransferTimeout: 2 * time.Hour, StallTimeout: time.Minute}, n.Leases,
		"defaults: nothing allowed, plain HTTP refused")

	c, err = Decode([]byte(`apiVersion: qemu-kubelet.io/v1alpha1
kind: NodeConfiguration
jumpstarter:
  fetch:
    allow: ["10.20.1.7/16", "192.168.5.5", "fd00::/8", "MinIO.lab.example"]
    clusterCIDRs: ["10.96.0.0/12", "10.244.0.0/16"]
    allowPlainHTTPRegistries: true
  maxConcurrentTransfers: 2
  transferTimeout: 30m
  stallTimeout: 15s
`))
	require.NoError(t, err)
	n, err = Resolve(c, env)
	require.NoError(t, err)
	assert.Equal(t, LeasesConfig{
		AllowNets:                []netip.Prefix{netip.MustParsePrefix("10.20.0.0/16"), netip.MustParsePrefix("192.168.5.5/32"), netip.MustParsePrefix("fd00::/8")},
		AllowHosts:               []string{"minio.lab.example"},
		ClusterCIDRs:             []netip.Prefix{netip.MustParsePrefix("10.96.0.0/12"), netip.MustParsePrefix("10.244.0.0/16")},
		AllowPlainHTTPRegistries: true, MaxConcurrentTransfers: 2, TransferTimeout: 30 * time.Minute, StallTimeout: 15 * time.Second,
	}, n.Leases)

	c, err = Decode([]byte(`apiVersion: qemu-kubelet.io/v1alpha1
kind: NodeConfiguration
jumpstarter:
  fetch:
    allow: ["10.20.0.0/33", "not a host!"]
    clusterCIDRs: ["10.96.0.0"]
  maxConcurrentTransfers: 0
  transferTimeout: soon
  stallTimeout: 1ms
`))
	require.NoError(t, err)
	_, err = Resolve(c, env)
	require.Error(t, err)
	for _, want := range []string{
		`jumpstarter.fetch.allow[0]: Invalid value: "10.20.0.0/33": must be a CIDR (10.20.0.0/16) or a host name`,
		`jumpstarter.fetch.allow[1]: Invalid value: "not a host!": must be a CIDR, an address or a host name`,
		`jumpstarter.fetch.clusterCIDRs[0]: Invalid value: "10.96.0.0": must be a CIDR such as 10.96.0.0/12`,
		`jumpstarter.maxConcurrentTransfers: Invalid value: 0: must be 1 to 1000`,
		`jumpstarter.transferTimeout: Invalid value: "soon": must be a duration`,
		`jumpstarter.stallTimeout: Invalid value: "1ms": must be at least 1s`,
	} {
		assert.Contains(t, err.Error(), want)
	}
}
