package jumpstarter

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"time"
)

// FetchPolicy says where the exporter may connect on a lease holder's
// behalf: presigned_request URLs (flash's GET, dump's PUT, every redirect
// they take) and flash_oci's registries. A lease holder chooses those
// addresses, so by default none of the node's own networks is reachable:
// loopback, link-local (cloud metadata), the node's own addresses,
// private ranges (RFC 1918, carrier-grade NAT 100.64.0.0/10, IPv6 unique
// local fc00::/7), the cluster's ranges (Deny) and other special-use
// ranges are refused. For presigned requests the check is on the address
// each connection dials (a net.Dialer Control func), so a name that
// resolves differently later (DNS rebinding) cannot route around it.
// The zero value is the default policy.
type FetchPolicy struct {
	// AllowNets and AllowHosts are a lab's own storage and registries:
	// addresses in AllowNets and host names in AllowHosts (as the URL or
	// reference names them, case-insensitive) are reached even in a
	// refused range.
	AllowNets  []netip.Prefix
	AllowHosts []string
	// Deny are ranges refused besides the built-in ones: the cluster's
	// service and pod ranges.
	Deny []netip.Prefix
	// PlainHTTPRegistries are the registries (host[:port]) the node pulls
	// from over plain HTTP (its image settings); loopback registries are
	// plain HTTP too. flash_oci refuses them unless AllowPlainHTTP.
	PlainHTTPRegistries []string
	AllowPlainHTTP      bool
	// NodeAddresses are the node's own addresses (nil: the host's
	// interface addresses, read at every check).
	NodeAddresses func() []netip.Addr
}

// refusedNets are the built-in refused ranges besides loopback,
// link-local, multicast and unspecified addresses (net/netip's own
// predicates) and private ones (IsPrivate: 10/8, 172.16/12, 192.168/16,
// fc00::/7).
var refusedNets = []struct {
	net  netip.Prefix
	what string
}{
	{netip.MustParsePrefix("0.0.0.0/8"), `"this network" (0.0.0.0/8)`},
	{netip.MustParsePrefix("100.64.0.0/10"), "carrier-grade NAT space (100.64.0.0/10)"},
	{netip.MustParsePrefix("192.0.0.0/24"), "IETF protocol assignments (192.0.0.0/24)"},
	{netip.MustParsePrefix("198.18.0.0/15"), "benchmarking space (198.18.0.0/15)"},
	{netip.MustParsePrefix("240.0.0.0/4"), "reserved space (240.0.0.0/4)"},
	{netip.MustParsePrefix("64:ff9b:1::/48"), "local-use NAT64 space (64:ff9b:1::/48)"},
}

// AllowedHost says whether host (as a URL names it) is on the allow-list.
func (p FetchPolicy) AllowedHost(host string) bool {
	host = strings.TrimSuffix(strings.ToLower(strings.Trim(host, "[]")), ".")
	for _, h := range p.AllowHosts {
		if strings.TrimSuffix(strings.ToLower(h), ".") == host {
			return true
		}
	}
	return false
}

// Check says why the exporter may not connect to ip for a lease (nil: it
// may). node are the node's own addresses. Pure.
func (p FetchPolicy) Check(ip netip.Addr, node []netip.Addr) error {
	ip = ip.Unmap()
	for _, n := range p.AllowNets {
		if n.Contains(ip) {
			return nil
		}
	}
	why := ""
	switch {
	case ip.IsLoopback() || ip.IsUnspecified():
		why = "the node itself"
	case ip.IsMulticast():
		why = "multicast"
	case ip.IsLinkLocalUnicast():
		why = "link-local (cloud metadata services live there)"
	}
	for _, a := range node {
		if why == "" && a.Unmap() == ip {
			why = "one of the node's own addresses"
		}
	}
	for _, n := range p.Deny {
		if why == "" && n.Contains(ip) {
			why = "in the cluster's range " + n.String()
		}
	}
	if why == "" && ip.IsPrivate() {
		why = "in a private range (RFC 1918 or IPv6 unique local)"
	}
	for _, n := range refusedNets {
		if why == "" && n.net.Contains(ip) {
			why = "in " + n.what
		}
	}
	if why == "" {
		return nil
	}
	return &RefusedError{Addr: ip, Why: why}
}

// RefusedError is an address the fetch policy refuses; it is an
// ErrInvalidArgument.
type RefusedError struct {
	Addr netip.Addr
	Why  string
}

func (e *RefusedError) Error() string {
	return fmt.Sprintf("%v: address %s is %s: the node does not connect there for a lease (the node's jumpstarter.fetch.allow lists what may be reached)", ErrInvalidArgument, e.Addr, e.Why)
}

func (e *RefusedError) Unwrap() error { return ErrInvalidArgument }

func (p FetchPolicy) nodeAddresses() []netip.Addr {
	if p.NodeAddresses != nil {
		return p.NodeAddresses()
	}
	return HostAddresses()
}

// HostAddresses are the addresses of the host's interfaces.
func HostAddresses() []netip.Addr {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil
	}
	out := make([]netip.Addr, 0, len(addrs))
	for _, a := range addrs {
		if pfx, err := netip.ParsePrefix(a.String()); err == nil {
			out = append(out, pfx.Addr())
		}
	}
	return out
}

// dialContext dials as base does, refusing at dial time every address
// the policy refuses (the address of each connection attempt, after name
// resolution), but for host names on the allow-list.
func (p FetchPolicy) dialContext(base *net.Dialer) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		host, _, err := net.SplitHostPort(addr)
		if err != nil {
			return nil, err
		}
		if p.AllowedHost(host) {
			return base.DialContext(ctx, network, addr)
		}
		node := p.nodeAddresses()
		d := *base
		d.Control = func(_, address string, _ syscall.RawConn) error {
			h, _, err := net.SplitHostPort(address)
			if err != nil {
				return err
			}
			ip, err := netip.ParseAddr(h)
			if err != nil {
				return fmt.Errorf("address %q: %w", h, err)
			}
			return p.Check(ip, node)
		}
		return d.DialContext(ctx, network, addr)
	}
}

// Dialer is the policy as a Dialer (OCIFlash.Dial): each connection's
// address is checked at dial time, as for presigned requests.
func (p FetchPolicy) Dialer() Dialer {
	return dialFunc(p.dialContext(&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}))
}

type dialFunc func(ctx context.Context, network, addr string) (net.Conn, error)

func (f dialFunc) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	return f(ctx, network, addr)
}

// registryHost is the registry host[:port] of an image reference, as
// Docker names it (no domain: docker.io).
func registryHost(ref string) string {
	first, _, found := strings.Cut(ref, "/")
	if !found || (!strings.ContainsAny(first, ".:") && first != "localhost") {
		return "docker.io"
	}
	return strings.ToLower(first)
}

// CheckRegistry says why flash_oci may not pull ref for a lease (nil: it
// may): a plain-HTTP registry (a loopback one, or one the node's image
// settings pull over plain HTTP) unless allowed, a registry whose name
// resolves into a refused range unless allowed. It is the early, clear
// refusal; the pull itself dials through Dialer, which checks every
// address it connects to (the registry's, its token service's, its
// redirects'), so a name that resolves differently later gains nothing.
func (p FetchPolicy) CheckRegistry(ctx context.Context, ref string) error {
	hp := registryHost(ref)
	host := hp
	if h, _, err := net.SplitHostPort(hp); err == nil {
		host = h
	}
	host = strings.Trim(host, "[]")
	plain := host == "localhost"
	if ip, err := netip.ParseAddr(host); err == nil && ip.IsLoopback() {
		plain = true
	}
	for _, r := range p.PlainHTTPRegistries {
		plain = plain || strings.EqualFold(r, hp)
	}
	if plain && !p.AllowPlainHTTP {
		return fmt.Errorf("%w: registry %s is reached over plain HTTP: the node does not pull over plain HTTP for a lease (the node's jumpstarter.fetch.allowPlainHTTPRegistries)", ErrInvalidArgument, hp)
	}
	if p.AllowedHost(host) {
		return nil
	}
	ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
	if err != nil {
		return nil // a name that does not resolve reaches nothing: the pull says so
	}
	node := p.nodeAddresses()
	for _, ip := range ips {
		if err := p.Check(ip, node); err != nil {
			return fmt.Errorf("registry %s: %w", hp, err)
		}
	}
	return nil
}
