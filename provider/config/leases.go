package config

import (
	"net/netip"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

// Defaults of the jumpstarter section.
const (
	DefaultMaxConcurrentTransfers = 4
	DefaultTransferTimeout        = "2h"
	DefaultTransferStallTimeout   = "60s"
)

// Leases bounds what a Jumpstarter lease holder may make the node do
// through its pods' exporters (docs/multi-tenant.md): where flashes and
// dumps may fetch and send, how many run at once and for how long.
type Leases struct {
	// Fetch says where presigned URLs and flash_oci registries may be
	// reached.
	Fetch LeaseFetch `json:"fetch,omitempty"`
	// MaxConcurrentTransfers is how many flashes and dumps (from files,
	// presigned URLs, OCI images) run at once on the node; more wait their
	// turn (default 4).
	MaxConcurrentTransfers *int32 `json:"maxConcurrentTransfers,omitempty"`
	// TransferTimeout bounds one flash or dump from start to end
	// (duration, default 2h).
	TransferTimeout string `json:"transferTimeout,omitempty"`
	// StallTimeout fails a transfer whose peer sends or takes nothing for
	// this long (duration, default 60s).
	StallTimeout string `json:"stallTimeout,omitempty"`
}

// LeaseFetch is where a lease's presigned requests and flash_oci
// registries may go. Loopback, link-local, the node's own addresses,
// private ranges (RFC 1918, 100.64.0.0/10, fc00::/7) and ClusterCIDRs are
// refused unless Allow lists them.
type LeaseFetch struct {
	// Allow lists a lab's own storage and registries: CIDRs
	// ("10.20.0.0/16") and host names ("minio.lab.example").
	Allow []string `json:"allow,omitempty"`
	// ClusterCIDRs are the cluster's service and pod ranges, refused too
	// (they are usually private ranges already).
	ClusterCIDRs []string `json:"clusterCIDRs,omitempty"`
	// AllowPlainHTTPRegistries lets flash_oci pull from registries the
	// node reaches over plain HTTP (loopback ones, images.registries with
	// plainHTTP). Default false.
	AllowPlainHTTPRegistries *bool `json:"allowPlainHTTPRegistries,omitempty"`
}

// LeasesConfig is the resolved jumpstarter section.
type LeasesConfig struct {
	AllowNets                []netip.Prefix
	AllowHosts               []string
	ClusterCIDRs             []netip.Prefix
	AllowPlainHTTPRegistries bool
	MaxConcurrentTransfers   int
	TransferTimeout          time.Duration
	StallTimeout             time.Duration
}

func defaultLeases(c *Leases) {
	defaultInt32(&c.MaxConcurrentTransfers, DefaultMaxConcurrentTransfers)
	if c.TransferTimeout == "" {
		c.TransferTimeout = DefaultTransferTimeout
	}
	if c.StallTimeout == "" {
		c.StallTimeout = DefaultTransferStallTimeout
	}
	defaultBool(&c.Fetch.AllowPlainHTTPRegistries, false)
}

func validateLeases(c Leases, errs field.ErrorList) (LeasesConfig, field.ErrorList) {
	p := field.NewPath("jumpstarter")
	var out LeasesConfig
	for i, a := range c.Fetch.Allow {
		ap := p.Child("fetch", "allow").Index(i)
		if strings.Contains(a, "/") {
			pfx, err := netip.ParsePrefix(a)
			if err != nil {
				errs = append(errs, field.Invalid(ap, a, "must be a CIDR (10.20.0.0/16) or a host name"))
				continue
			}
			out.AllowNets = append(out.AllowNets, pfx.Masked())
			continue
		}
		if ip, err := netip.ParseAddr(a); err == nil {
			out.AllowNets = append(out.AllowNets, netip.PrefixFrom(ip, ip.BitLen()))
			continue
		}
		if msgs := validation.IsDNS1123Subdomain(strings.ToLower(a)); len(msgs) > 0 {
			errs = append(errs, field.Invalid(ap, a, "must be a CIDR, an address or a host name: "+strings.Join(msgs, "; ")))
			continue
		}
		out.AllowHosts = append(out.AllowHosts, strings.ToLower(a))
	}
	for i, a := range c.Fetch.ClusterCIDRs {
		pfx, err := netip.ParsePrefix(a)
		if err != nil {
			errs = append(errs, field.Invalid(p.Child("fetch", "clusterCIDRs").Index(i), a, "must be a CIDR such as 10.96.0.0/12"))
			continue
		}
		out.ClusterCIDRs = append(out.ClusterCIDRs, pfx.Masked())
	}
	out.AllowPlainHTTPRegistries = *c.Fetch.AllowPlainHTTPRegistries
	if n := *c.MaxConcurrentTransfers; n < 1 || n > 1000 {
		errs = append(errs, field.Invalid(p.Child("maxConcurrentTransfers"), n, "must be 1 to 1000"))
	}
	out.MaxConcurrentTransfers = int(*c.MaxConcurrentTransfers)
	out.TransferTimeout, errs = parseDuration(p.Child("transferTimeout"), c.TransferTimeout, time.Second, errs)
	out.StallTimeout, errs = parseDuration(p.Child("stallTimeout"), c.StallTimeout, time.Second, errs)
	return out, errs
}
