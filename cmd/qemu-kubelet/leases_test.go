package main

import (
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
)

// TestLeaseLimits: the node's jumpstarter section becomes every
// exporter's resource options: its fetch policy (the registries the node
// pulls over plain HTTP included) and one transfer limiter for the node.
func TestLeaseLimits(t *testing.T) {
	c, err := config.Decode([]byte(`apiVersion: qemu-kubelet.io/v1alpha1
kind: NodeConfiguration
images:
  registries:
    "registry.lab:5000": {plainHTTP: true}
    "quay.io": {}
jumpstarter:
  fetch:
    allow: ["10.20.0.0/16", "minio.lab"]
    clusterCIDRs: ["10.96.0.0/12"]
  maxConcurrentTransfers: 3
  transferTimeout: 20m
`))
	require.NoError(t, err)
	n, err := config.Resolve(c, config.Environment{Hostname: "h", HostIP: "10.0.0.5"})
	require.NoError(t, err)
	o := leaseLimits(n)
	assert.Equal(t, []netip.Prefix{netip.MustParsePrefix("10.20.0.0/16")}, o.Fetch.AllowNets)
	assert.Equal(t, []string{"minio.lab"}, o.Fetch.AllowHosts)
	assert.Equal(t, []netip.Prefix{netip.MustParsePrefix("10.96.0.0/12")}, o.Fetch.Deny)
	assert.Equal(t, []string{"registry.lab:5000"}, o.Fetch.PlainHTTPRegistries)
	assert.False(t, o.Fetch.AllowPlainHTTP)
	assert.Equal(t, 20*time.Minute, o.TransferTimeout)
	assert.Equal(t, time.Minute, o.StallTimeout)
	require.NotNil(t, o.Transfers)
	assert.Equal(t, 3, o.Transfers.Max())
	assert.False(t, o.AllowLocalFetch)
}
