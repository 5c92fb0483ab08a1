package config

import (
	"fmt"
	"maps"
	"net/url"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

// Defaults of the image cache settings.
const (
	DefaultImageGCMaxSize      QuantityString = "20Gi"
	DefaultImageGCMaxUnusedAge                = "168h"
	DefaultImageGCPeriod                      = "5m"
)

// Images configures the OS image cache (<stateDir>/images) and the
// registries images are pulled from.
type Images struct {
	// GCMaxSize bounds the cache: least recently used images not used by a
	// VM are removed beyond it (quantity, default 20Gi; "0" disables).
	GCMaxSize QuantityString `json:"gcMaxSize,omitempty"`
	// GCMaxUnusedAge removes images no VM used for this long (duration,
	// default 168h; "0s" disables).
	GCMaxUnusedAge string `json:"gcMaxUnusedAge,omitempty"`
	// GCPeriod is how often the cache is collected (duration, default 5m).
	GCPeriod string `json:"gcPeriod,omitempty"`
	// Registries holds per-registry settings keyed by host[:port] as it
	// appears in image references. Loopback registries use plain HTTP
	// without configuration.
	Registries map[string]Registry `json:"registries,omitempty"`
}

// Registry is the setting of one registry host.
type Registry struct {
	// PlainHTTP talks http:// instead of https://.
	PlainHTTP bool `json:"plainHTTP,omitempty"`
	// InsecureSkipVerify disables TLS certificate verification.
	InsecureSkipVerify bool `json:"insecureSkipVerify,omitempty"`
	// Mirrors are tried in order before the registry: "host[:port]" or
	// "http(s)://host:port[/prefix]".
	Mirrors []string `json:"mirrors,omitempty"`
}

// ImageCache is the resolved image cache configuration.
type ImageCache struct {
	GCMaxBytes int64
	GCMaxAge   time.Duration
	GCPeriod   time.Duration
	Registries map[string]Registry
}

func defaultImages(c *Images) {
	if c.GCMaxSize == "" {
		c.GCMaxSize = DefaultImageGCMaxSize
	}
	if c.GCMaxUnusedAge == "" {
		c.GCMaxUnusedAge = DefaultImageGCMaxUnusedAge
	}
	if c.GCPeriod == "" {
		c.GCPeriod = DefaultImageGCPeriod
	}
}

func validateImages(c Images, errs field.ErrorList) (ImageCache, field.ErrorList) {
	p := field.NewPath("images")
	out := ImageCache{Registries: maps.Clone(c.Registries)}
	q, err := resource.ParseQuantity(string(c.GCMaxSize))
	switch {
	case err != nil:
		errs = append(errs, field.Invalid(p.Child("gcMaxSize"), c.GCMaxSize, "must be a quantity such as 20Gi (0 disables)"))
	case q.Sign() < 0:
		errs = append(errs, field.Invalid(p.Child("gcMaxSize"), c.GCMaxSize, "must not be negative"))
	default:
		out.GCMaxBytes = q.Value()
	}
	out.GCMaxAge, errs = parseDuration(p.Child("gcMaxUnusedAge"), c.GCMaxUnusedAge, 0, errs)
	out.GCPeriod, errs = parseDuration(p.Child("gcPeriod"), c.GCPeriod, time.Second, errs)
	for _, host := range slices.Sorted(maps.Keys(c.Registries)) {
		rp := p.Child("registries").Key(host)
		if host == "" || strings.ContainsAny(host, "/ \t") {
			errs = append(errs, field.Invalid(rp, host, "must be a registry host[:port] as it appears in image references"))
		}
		for i, m := range c.Registries[host].Mirrors {
			if strings.Contains(m, "://") {
				u, err := url.Parse(m)
				if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
					errs = append(errs, field.Invalid(rp.Child("mirrors").Index(i), m, fmt.Sprintf("must be host[:port] or an http(s) URL%s", errSuffix(err))))
				}
			} else if m == "" || strings.ContainsAny(m, "/ \t") {
				errs = append(errs, field.Invalid(rp.Child("mirrors").Index(i), m, "must be host[:port] or an http(s) URL"))
			}
		}
	}
	return out, errs
}

func errSuffix(err error) string {
	if err == nil {
		return ""
	}
	return ": " + err.Error()
}
